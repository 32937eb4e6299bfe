"""What every benchmark shares: the import path, the device measured and the commit, timing,
peak-memory measurement, running one measurement in a fresh process, and the results CSV.

A benchmark script is then only its set-up (inputs, providers, grid) and a call to these.
Importing this module puts the repository root on ``sys.path`` (the scripts run from a
checkout that need not be pip-installed).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nnkloss.atomic import atomic_write  # noqa: E402
from nnkloss.experiment import reporting  # noqa: E402
from nnkloss.experiment.setup import resolve_device  # noqa: E402

__all__ = ["HERE", "ROOT", "git_commit", "device_name", "cpu_name", "slug", "utc_now", "time_ms",
           "kernel_ms", "wall_ms", "PeakRss", "run_isolated", "worker_reply", "add_worker_args", "parse_or_work",
           "ResultsCsv", "migrate_csv", "results_path", "parse_device",
           "read_gbps", "tensor_read_gbps", "gather_gbps", "process_limits", "max_limits",
           "median_round", "load_average"]


def git_commit(cwd: str = HERE) -> str:
    """The commit a figure is labelled with (:func:`nnkloss.experiment.reporting.git_commit`:
    ``-dirty`` for changed code, not for results files; $NNKLOSS_COMMIT where set), "unknown"
    outside a checkout."""
    return reporting.git_commit(cwd) or "unknown"


def parse_device(ap: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device`` checked before any work (:func:`nnkloss.experiment.setup.resolve_device`):
    a name that is no device, or a CUDA device this machine lacks, ends the script with the
    parser's error naming --device (torch's own came at the first tensor moved there)."""
    try:
        return resolve_device(name)
    except (ValueError, RuntimeError) as exc:
        ap.error(str(exc))


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's from /proc/cpuinfo (:func:`cpu_name`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_name(f.read())
    except OSError:
        return "cpu"


def cpu_name(cpuinfo: str) -> str:
    """The first CPU's model name, with its family and model numbers where /proc/cpuinfo gives
    them: a VM may show only "AMD EPYC", and two machines of that name (an AVX2 part with 512
    KiB of L2 a core, and a family 26 part with AVX-512) ran the op's forward 1.3-4.8x apart,
    so the numbers keep their results files apart. "cpu" where there is no model name."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return "cpu"
    if fields.get("cpu family") and fields.get("model"):
        name += f" family {fields['cpu family']} model {fields['model']}"
    return name


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def results_path(out_dir: str, device: torch.device, prefix: str = "", ext: str = ".csv") -> str:
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{prefix}{slug(device_name(device))}{ext}")


def time_ms(fn, device, reps=100, warmup=2, iters=7) -> float:
    """Median milliseconds of ``fn()``: triton's do_bench for ``reps`` ms on CUDA; on CPU
    ``warmup`` untimed calls, then the median of ``iters`` timed calls."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=reps, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def wall_ms(fn, device, reps=100, min_rounds=5) -> float:
    """Milliseconds a call of ``fn()`` adds to a loop of back-to-back calls (CUDA): what a
    training loop sees, the host's time where the host bounds the call and the device's where
    the device does, with no flush between calls (a loop's next step finds the caches as the
    last left them). Rounds of ``n`` calls, one synchronisation at the end of each, ``n`` such
    that a round takes about 2 ms; rounds for about ``reps`` ms (at least ``min_rounds``); the
    median round's time over ``n``. Elsewhere :func:`time_ms` (each call timed on its own: on
    a CPU the call returns when its work is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time_ms(fn, device, reps)
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    n = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t, 1e-6))))
    rounds = []
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < reps or len(rounds) < min_rounds:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - t) * 1e3 / n)
    return sorted(rounds)[len(rounds) // 2]


def kernel_ms(fn, device, reps=100, calls=20, flush_mb=256) -> float:
    """Device milliseconds of one ``fn()`` with the host's time taken out (CUDA), for kernel
    against kernel comparisons (tune_loss.py); elsewhere :func:`time_ms`.

    do_bench flushes the L2 before each call and times the call between two events; when the
    host takes longer to launch the call than the GPU takes to flush (a Triton launch ~60 us
    of Python on an H200's host, the flush ~62 us), the GPU waits on the host between the
    events and the figure is the host's. On an H200 (``a53e2f6``) the same 20-60 us kernel
    (B 128, K 100, D 128) measured 0.017 and 0.061 ms in two processes this way. Here ``calls``
    calls, each after the same flush, are captured in one CUDA graph, and so are the flushes
    alone; both graphs are replayed in turn for about ``reps`` ms, and the figure is the
    difference of their median replay times, per call. The host's Python never runs on a
    replay, so ``fn`` must be capturable (no host sync, no CPU work the result depends on).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return time_ms(fn, device, reps)
    cache = torch.empty(flush_mb << 20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (compiles, allocator) off the capturing stream
        for _ in range(3):
            cache.zero_()
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    both, flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(both):
        for _ in range(calls):
            cache.zero_()
            fn()
    with torch.cuda.graph(flush):
        for _ in range(calls):
            cache.zero_()

    def replay_ms(graph):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    replay_ms(both), replay_ms(flush)  # first replays: uploads, clocks
    t_both, t_flush = [], []
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < reps or len(t_both) < 5:
        t_both.append(replay_ms(both))
        t_flush.append(replay_ms(flush))
    med = lambda t: sorted(t)[len(t) // 2]  # noqa: E731
    return max(0.0, med(t_both) - med(t_flush)) / calls


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRss:
    """Peak resident memory of this process above the RSS at ``start()``, in MiB.

    Method: ``start()`` writes 5 to /proc/self/clear_refs (resets the kernel's high-water mark
    VmHWM to the current RSS) and records VmRSS; ``peak_mb()`` is VmHWM - that RSS. Where
    clear_refs cannot be written, a thread samples VmRSS every millisecond instead (may miss
    short peaks); ``method`` says which. Before the baseline the C heap's free memory goes
    back to the system (glibc's ``malloc_trim``): memory an earlier call freed but the heap
    kept resident would otherwise serve the measured call without raising the RSS (a
    warmed-up call's 3.8 MiB output read 0.0 MiB).
    """

    def __init__(self):
        self.method = None
        self._base = 0
        self._max = 0
        self._stop = None

    def start(self):
        _trim_heap()
        self._base = _status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._max = self._base
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._max = max(self._max, _status_kb("VmRSS"))
                    time.sleep(0.001)
            threading.Thread(target=sample, daemon=True).start()
        return self

    def peak_mb(self) -> float:
        if self._stop is None:
            peak = _status_kb("VmHWM")
        else:
            peak = max(self._max, _status_kb("VmRSS"))
            self._stop.set()
        return (peak - self._base) / 1024


def worker_reply(result: dict) -> None:
    """What a worker process prints as its last stdout line (read by ``run_isolated``)."""
    print("RESULT " + json.dumps(result), flush=True)


def add_worker_args(ap: argparse.ArgumentParser, timeout: Optional[float] = None) -> None:
    """The arguments of a benchmark whose measurements run in fresh processes: ``--out`` (the
    results directory), ``--timeout`` (seconds per worker, when ``timeout`` is given) and the
    hidden ``--worker JSON`` that :func:`run_isolated` passes."""
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    if timeout is not None:
        ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def parse_or_work(ap: argparse.ArgumentParser, argv, worker):
    """Parse ``argv``; in a worker process (``--worker JSON``) run ``worker(spec)`` and return
    None, else return the parsed arguments."""
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return None
    return args


def run_isolated(script: str, spec: dict, timeout: float = 1800) -> dict:
    """Run ``python script --worker JSON(spec)`` in a fresh interpreter and return the dict
    it passed to ``worker_reply`` (``{"error": ...}`` when it failed)."""
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"worker exited {proc.returncode}: {tail}"}


def migrate_csv(path: str, columns, fill: Optional[dict] = None) -> None:
    """Rewrite, atomically, a CSV written with other columns under ``columns``: its rows keep
    their values, and a column they lack takes ``fill[column]`` ("" where fill names none).
    Nothing is written when the header is already ``columns``."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == list(columns):
            return
        old = list(reader)
    fill = fill or {}
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    for r in old:
        r.update((c, fill.get(c, "")) for c in missing)

    def rows(out):
        text = io.StringIO()
        w = csv.DictWriter(text, columns, extrasaction="ignore", restval="")
        w.writeheader()
        w.writerows(old)
        out.write(text.getvalue().encode())
    atomic_write(path, rows)


class ResultsCsv:
    """Append-only CSV with a fixed header (written once, when the file is new); every row is
    flushed as it is written so an interrupted run keeps what it measured. A file written
    with other columns (an older version of the script) is first rewritten, atomically, under
    the new header: its rows keep their values, columns they lack are left empty."""

    def __init__(self, path: str, columns):
        self.path = path
        self.columns = list(columns)
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        if not new:
            self._migrate()
        self._f = open(path, "a", newline="")
        self._w = csv.writer(self._f)
        if new:
            self._w.writerow(self.columns)

    def _migrate(self):
        migrate_csv(self.path, self.columns)

    def write(self, row, echo=True):
        if isinstance(row, dict):
            row = [row.get(c, "") for c in self.columns]
        assert len(row) == len(self.columns), (row, self.columns)
        self._w.writerow(row)
        self._f.flush()
        if echo:
            print(",".join(str(v) for v in row), flush=True)

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_gbps(device, nbytes: int = 2 ** 30, iters: int = 7) -> float:
    """STREAM-like read bandwidth in GB/s: the median time of summing an ``nbytes`` fp32 array
    (far beyond the caches; each element read once, nothing written but the sum) on torch's
    threads (set them first). The limit a gather-bound op is measured against."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    gbps = tensor_read_gbps(a, iters)
    del a
    return gbps


def tensor_read_gbps(t, iters: int = 21) -> Optional[float]:
    """GB/s of one sequential read of ``t``'s bytes where they live now (a cache, or memory):
    the median time of a sum over them viewed as fp32 (torch's integer sums are not
    vectorised: 40x slower); a trailing 1-3 bytes are left out. None for under 4 bytes."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() < 4:
        return None
    flat = raw[:raw.numel() // 4 * 4].view(torch.float32)
    ms = time_ms(lambda: flat.sum(), t.device, reps=200, warmup=2, iters=iters)
    return flat.numel() * 4 / ms / 1e6


def gather_gbps(bank, neighbours, iters: int = 21) -> Optional[float]:
    """GB/s of the gather limit: the rows of ``bank`` that ``neighbours`` names, read in their
    order the way the op's first pass reads them (``nnkloss.ops.cpu.gather_read``: the same
    prefetching, no arithmetic but an XOR), on torch's threads: median of ``iters`` calls after
    2 warm-ups, bytes = the non-padding entries times the row's bytes. What a random row gather
    of that shape can reach where the bank lives (a sequential read, ``read_gbps``, is faster on
    a machine whose random accesses cost more than its streaming does). None without the
    compiled library or off the CPU."""
    from nnkloss.ops import cpu
    if not bank.is_cpu or not cpu.available():
        return None
    rows = int((neighbours >= 0).sum())
    if rows == 0:
        return None
    ms = time_ms(lambda: cpu.gather_read(bank, neighbours), bank.device, warmup=2, iters=iters)
    return rows * bank.shape[1] * bank.element_size() / ms / 1e6


def process_limits(bank, lists, read_bytes: int = 2 ** 30) -> dict:
    """The limits a gather-bound call is held against, measured where and when it runs (call
    it in the measuring process, beside the calls, on their threads): ``read_gbps``, the
    machine's sequential read (:func:`read_gbps` of ``read_bytes``; on CPU only, None on a GPU,
    whose HBM read held within 0.5% across a card's runs: the run's own read serves there),
    ``bank_read_gbps`` (a sequential read of ``bank`` where it lives) and ``gather_gbps`` (the
    rows ``lists`` names, :func:`gather_gbps`; None off the CPU). On the shared 2-core VM the
    read moved 29-45 GB/s within 20 s and 34-70 GB/s between runs (2026-11-26): a read taken
    minutes away measures another machine."""
    return {"read_gbps": read_gbps(bank.device, read_bytes) if bank.is_cpu else None,
            "bank_read_gbps": tensor_read_gbps(bank),
            "gather_gbps": gather_gbps(bank, lists)}


def max_limits(all_limits) -> dict:
    """Per limit the largest of several :func:`process_limits` (None where none was taken)."""
    all_limits = [lim or {} for lim in all_limits]
    keys = {k for lim in all_limits for k in lim}
    return {k: max((lim[k] for lim in all_limits if lim.get(k) is not None), default=None)
            for k in keys}


def median_round(rounds, key):
    """The round whose ``key`` is the median of the rounds' (the upper one for an even count):
    a benchmark's row takes that round's time and the limits measured in its own process."""
    return sorted(rounds, key=key)[len(rounds) // 2]


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages (what ``uptime`` shows), '' where unknown."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return ""
