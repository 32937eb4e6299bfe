"""What every benchmark shares: the import path, the device measured and the commit, timing
(wall, and the kernels alone through a CUDA graph), peak memory, running one measurement in a
fresh process, and the results table (one CSV per device and benchmark).

A benchmark script is then only its set-up (inputs, providers, grid) and a call to these.
Importing this module puts the repository root on ``sys.path`` (the scripts run from a
checkout that need not be pip-installed).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import json
import os
import re
import shlex
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

__all__ = ["HERE", "ROOT", "git_commit", "parse_device", "device_name", "cpu_name", "slug",
           "utc_now", "results_path", "time_ms", "wall_ms", "graph_ms", "PeakRss", "PeakMemory",
           "worker_reply", "add_worker_args", "parse_or_work", "run_isolated", "ResultsCsv",
           "TABLE_COLUMNS", "PASSES", "table_row", "command_line", "table_csv", "markdown",
           "plot", "read_gbps", "tensor_read_gbps", "median_round", "load_average"]


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
    them (a VM may show only the vendor's family name for two quite different machines), so
    that their results files stay apart. "cpu" where there is no model name."""
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
    the device does. Rounds of ``n`` calls (``n`` such that a round takes about 2 ms), one
    synchronisation at the end of each, for about ``reps`` ms (at least ``min_rounds``); the
    median round's time over ``n``. Elsewhere :func:`time_ms` (on a CPU a call returns when
    its work is done)."""
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


def graph_ms(fn, device, reps=100, calls=10) -> Optional[float]:
    """Device milliseconds of one ``fn()`` with the host taken out (the kernels alone):
    ``calls`` back-to-back calls captured in one CUDA graph, replayed for about ``reps`` ms,
    the median replay over ``calls``. ``fn`` may run a backward (autograd's kernels are
    captured with the forward's) but must be capturable: no host synchronisation. The warm-up
    calls run on a side stream, as capture requires. None off CUDA: there is no graph."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < reps or len(times) < 5:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times[1:])[len(times[1:]) // 2] / calls  # the first replay uploads the graph


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
    kept resident would otherwise serve the measured call without raising the RSS.
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


class PeakMemory:
    """Peak memory above what was in use at ``start()``, in MiB, on ``device``: on CUDA the
    allocator's peak above its allocation at the start (synchronised at both ends), elsewhere
    the process's RSS (:class:`PeakRss`)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._rss = None
        self._base = 0

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._rss = PeakRss().start()
        return self

    def peak_mb(self) -> float:
        if self.device.type != "cuda":
            return self._rss.peak_mb()
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2 ** 20


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


class ResultsCsv:
    """One run's CSV with a fixed header: the file a run writes replaces the last run's (git
    keeps the history). Rows go to ``<path>.partial`` and are flushed as they are written, so
    an interrupted run keeps what it measured there; closing a complete run moves the file
    into place."""

    def __init__(self, path: str, columns):
        self.path = path
        self.columns = list(columns)
        self._f = open(path + ".partial", "w", newline="")
        self._w = csv.writer(self._f)
        self._w.writerow(self.columns)
        self._f.flush()

    def write(self, row, echo=True):
        if isinstance(row, dict):
            unknown = set(row) - set(self.columns)
            assert not unknown, (unknown, self.columns)
            row = [row.get(c, "") for c in self.columns]
        assert len(row) == len(self.columns), (row, self.columns)
        self._w.writerow(row)
        self._f.flush()
        if echo:
            print(",".join(str(v) for v in row), flush=True)

    def close(self, complete=True):
        """Close the file; a complete run's replaces the last run's, an incomplete one stays
        ``<path>.partial``."""
        self._f.close()
        if complete:
            os.replace(self.path + ".partial", self.path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(complete=exc_type is None)


# The benchmarks' table, one CSV per device and benchmark: operation x provider x pass
# (forward, backward, both), each row with its wall time (what a loop of calls sees), the
# kernels' time alone (one CUDA graph replayed; empty off CUDA), peak memory above what was
# allocated before, and the bytes read per call against the device's read bandwidth measured
# in the same run, for either time; and the command that made the row.
TABLE_COLUMNS = ["operation", "provider", "pass", "shape", "dtype", "wall_ms", "kernel_ms",
                 "peak_mb", "read_gb", "read_gbps", "pct_read_wall", "pct_read_kernel",
                 "threads", "device", "commit", "date", "command", "note"]
PASSES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "both"}


def table_row(operation, provider, pass_, shape, dtype, wall_ms=None, kernel_ms=None,
              peak_mb=None, read_bytes=None, read_gbps=None, note="", **fields) -> dict:
    """A row of TABLE_COLUMNS; the percentages of the read bandwidth are the bytes read per
    call over each time, against ``read_gbps`` (empty where a figure is missing)."""
    def pct(ms):
        if not (ms and read_bytes and read_gbps):
            return ""
        return f"{100 * read_bytes / ms / 1e6 / read_gbps:.1f}"
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    return dict(operation=operation, provider=provider, **{"pass": pass_}, shape=shape,
                dtype=dtype, wall_ms=fmt(wall_ms, ".4g"), kernel_ms=fmt(kernel_ms, ".4g"),
                peak_mb=fmt(peak_mb, ".1f"),
                read_gb=fmt(read_bytes and read_bytes / 1e9, ".4g"),
                read_gbps=fmt(read_gbps, ".4g"), pct_read_wall=pct(wall_ms),
                pct_read_kernel=pct(kernel_ms), date=utc_now(), note=note, **fields)


def command_line(script: str, argv) -> str:
    """The command that makes a benchmark's rows, as a row records it (``argv``: its
    arguments, ``sys.argv[1:]`` where None)."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["python3", os.path.relpath(os.path.abspath(script), ROOT), *argv])


def table_csv(out_dir: str, benchmark: str, device: torch.device) -> ResultsCsv:
    """The run's table, ``<out_dir>/<benchmark>_<device>.csv``."""
    return ResultsCsv(results_path(out_dir, device, prefix=f"{benchmark}_"), TABLE_COLUMNS)


def markdown(rows) -> str:
    """The rows of a table as markdown, one line per operation, shape, provider and pass."""
    head = ["operation", "shape", "dtype", "provider", "pass", "wall ms", "kernel ms",
            "peak MB", "% of read (wall)", "% of read (kernel)", "note"]
    keys = ["operation", "shape", "dtype", "provider", "pass", "wall_ms", "kernel_ms",
            "peak_mb", "pct_read_wall", "pct_read_kernel", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows, png_path: str, title: str) -> None:
    """A panel per pass, grouped bars per shape (a bar per provider, wall ms, log scale) with
    the kernels' time marked on each bar where there is one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("wall_ms")]
    if not rows:
        return
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    shapes = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    at = {(r["pass"], r["shape"], r["dtype"], r["provider"]): r for r in rows}
    w = 0.8 / len(provs)
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8, 1.8 * len(shapes) + 3),
                                                      3 * len(passes)), squeeze=False)
    for ax, p in zip(axes[:, 0], passes):
        for j, prov in enumerate(provs):
            xs = [i + (j - (len(provs) - 1) / 2) * w for i in range(len(shapes))]
            hits = [at.get((p, s, dt, prov)) for s, dt in shapes]
            ax.bar(xs, [float(h["wall_ms"]) if h else 0 for h in hits], w, label=prov,
                   color=f"C{j}")
            ax.scatter(xs, [float(h["kernel_ms"]) if h and h.get("kernel_ms") else float("nan")
                            for h in hits], marker="_", color="k", s=200, zorder=3)
        ax.set_yscale("log")
        ax.set_ylabel(f"{p}, ms")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{s}\n{dt}" for s, dt in shapes], fontsize=7)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{title} (bars: wall; black marks: kernels alone)")
    fig.tight_layout()
    try:
        atomic_write(png_path, lambda f: fig.savefig(f, dpi=110, format="png"))
    finally:
        plt.close(fig)


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
