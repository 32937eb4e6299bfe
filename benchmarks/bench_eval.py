"""Retrieval evaluation at scale: nnkloss.metrics.evaluate vs pytorch-metric-learning.

Recall@1/2/4/8 and MAP@R (and R-precision) of N x D embeddings in C equal classes (R = N/C - 1),
by nnkloss (one exact search, reduced block by block: the default torch search, and
``search_backend="faiss"``, the flat index PML uses) and by pytorch-metric-learning's
AccuracyCalculator (faiss flat index, ``k="max_bin_count"``; Recall@2/4/8 added as custom
metrics on its neighbour labels, over all queries as nnkloss counts them). Provider
``nnkloss-torch-mm`` (not run by default) is the default search with its CPU distance tiles
computed by torch.mm instead of the compiled library's GEMM (``torch_search.COMPILED_GEMM =
False``): the A/B of the two GEMMs. Each measurement runs
in a fresh process: wall time of the call and peak resident memory (VmHWM of the process, and
the part above the RSS before the call). With ``--device cuda`` the nnkloss providers search on
the GPU (the embeddings moved there before the clock starts, as a model's outputs already are,
after one small untimed evaluation that initialises CUDA and cuBLAS) and ``gpu_peak_mb`` is the
device's peak allocation above what the call started with; PML stays on the CPU, as it is
configured here.

``--threads`` runs every provider at each of the given thread counts (torch's, and faiss's
OpenMP threads where faiss is imported); ``--phases`` splits an nnkloss CPU search's seconds
into its parts (columns ``gemm_s``: the distance tiles' GEMM; ``select_s``: folding each tile
into the rows' selections; ``finish_s``: each block's pad, sort and decode; the rest of
``seconds`` is the metrics' torch ops and the tiles' augmented copies), timed by wrappers
around those calls in the worker: how each part scales with the threads, on a machine with
more cores than this project's 2.

    python benchmarks/bench_eval.py                       # N = 30,000 and 150,000, D 128, C 100
    python benchmarks/bench_eval.py --N 30000 --providers nnkloss
    python benchmarks/bench_eval.py --N 150000 --providers nnkloss --device cuda
    python benchmarks/bench_eval.py --N 150000 --providers nnkloss --threads 1 2 4 --phases

Appends one row per (N, provider) to ``benchmarks/results/eval_<device>.csv`` with the metric
values, whether they equal PML's bit for bit (and the largest difference), the 1-minute load
average before and after (``/proc/loadavg``: the machine is shared), device, commit and date.
A provider that fails (e.g. out of memory) gets a row with its error.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (PeakRss, ResultsCsv, add_worker_args, device_name, git_commit,  # noqa: E402
                    parse_device, parse_or_work, results_path, run_isolated, utc_now, worker_reply)

import torch  # noqa: E402

KS = (1, 2, 4, 8)
METRICS = [f"recall@{k}" for k in KS] + ["map@r", "r_precision"]
# --phases: seconds of an nnkloss CPU search's parts (time_phases)
PHASES = ["gemm_s", "select_s", "finish_s"]
COLUMNS = (["provider", "N", "D", "classes", "search_k", "seconds", "peak_rss_mb", "extra_mb",
            "gpu_peak_mb"]
           + METRICS + ["equal_to_pml", "max_abs_diff", "error", "load_before", "load_after",
                        "threads", "device", "commit", "date"] + PHASES)


def setup(n: int, d: int, classes: int, seed: int = 0):
    """(N, D) fp32 embeddings and (N,) labels: C equal classes in shuffled order, each a
    Gaussian around its own mean (means spread so that Recall@1 is neither 0 nor 1)."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) % classes)[torch.randperm(n, generator=g)]
    means = torch.randn(classes, d, generator=g) * 0.35
    emb = means[labels] + torch.randn(n, d, generator=g)
    return emb.contiguous(), labels


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_nnkloss(emb, labels, search_backend="auto", compiled_gemm=True) -> dict:
    from nnkloss.bank.search import torch_search
    from nnkloss.evaluation import metrics
    torch_search.COMPILED_GEMM = compiled_gemm  # a worker process of its own: no restore
    return metrics.evaluate(emb, labels, KS, search_backend=search_backend)


def time_phases() -> dict:
    """Time the parts of nnkloss's CPU search in this (worker) process: wrappers around the
    distance tiles' GEMM (``torch_search.distance_tile``), the folds of each tile into the
    selections (``KnnSelection.add`` / ``add_symmetric``) and each block's finish (pad, sort,
    decode: ``KnnSelection.finish``). Returns the dict (keys PHASES) of the seconds they add
    up; what a call spends outside them is its seconds less their sum. Each wrapper costs a
    clock read or two per call (~3,000 calls at N = 150,000)."""
    from nnkloss.bank.search import torch_search
    from nnkloss import cpu
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(key, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return call

    torch_search.distance_tile = timed("gemm_s", torch_search.distance_tile)
    for method, key in (("add", "select_s"), ("add_symmetric", "select_s"),
                        ("finish", "finish_s")):
        setattr(cpu.KnnSelection, method, timed(key, getattr(cpu.KnnSelection, method)))
    return spent


def set_threads(threads: int) -> None:
    """torch's thread count, and faiss's OpenMP threads where faiss is installed (its flat
    index, which nnkloss-faiss and PML search with, runs on them)."""
    torch.set_num_threads(threads)
    try:
        import faiss
    except ImportError:
        return
    faiss.omp_set_num_threads(threads)


def run_pml(emb, labels) -> dict:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    def recall(k):
        def calc(self, knn_labels, query_labels, **kwargs):
            same = knn_labels[:, :k] == query_labels[:, None]
            return float(same.any(dim=1).type(torch.float64).mean())
        return calc

    extra = {f"calculate_recall_at_{k}": recall(k) for k in KS[1:]}
    extra["requires_knn"] = lambda self: (AccuracyCalculator.requires_knn(self)
                                          + [f"recall_at_{k}" for k in KS[1:]])
    calc_cls = type("RecallAccuracyCalculator", (AccuracyCalculator,), extra)
    calc = calc_cls(include=("precision_at_1", "mean_average_precision_at_r", "r_precision")
                    + tuple(f"recall_at_{k}" for k in KS[1:]), k="max_bin_count",
                    device=torch.device("cpu"))
    res = calc.get_accuracy(emb, labels)
    out = {"recall@1": res["precision_at_1"], "map@r": res["mean_average_precision_at_r"],
           "r_precision": res["r_precision"]}
    out.update({f"recall@{k}": res[f"recall_at_{k}"] for k in KS[1:]})
    return out


def prepare(provider: str, device="cpu") -> None:
    """Outside the timed region: nnkloss's compiled library built (the first use after a
    change of its source compiles it, ~20 s) and loaded; nothing for PML, nor for a search on
    the GPU, which does not use it (on a fresh GPU machine the build is device time spent on
    nothing)."""
    if provider != "pml" and torch.device(device).type == "cpu":
        from nnkloss import cpu
        cpu.available()


def worker(spec: dict) -> None:
    if spec.get("threads"):
        set_threads(spec["threads"])
    emb, labels = setup(spec["N"], spec["D"], spec["classes"])
    device = torch.device(spec.get("device", "cpu"))
    prepare(spec["provider"], device)
    on_gpu = spec["provider"] != "pml" and device.type == "cuda"
    # the parts of the CPU search: the default search and its torch.mm A/B (nnkloss-faiss
    # searches in faiss, whose parts are not seen here)
    phases = (time_phases() if spec.get("phases") and device.type == "cpu"
              and spec["provider"] in ("nnkloss", "nnkloss-torch-mm") else None)

    def run(emb, labels):
        if spec["provider"] == "pml":
            return run_pml(emb, labels)
        return run_nnkloss(emb, labels, "faiss" if spec["provider"] == "nnkloss-faiss"
                           else "auto", spec["provider"] != "nnkloss-torch-mm")

    if on_gpu:
        emb, labels = emb.to(device), labels.to(device)
        run(emb[:1000], labels[:1000])  # CUDA's context, cuBLAS's handles: not evaluation
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gpu_base = torch.cuda.memory_allocated(device)
    meter = PeakRss().start()
    t0 = time.perf_counter()
    values = run(emb, labels)  # python floats: the GPU's work is done when they are
    seconds = time.perf_counter() - t0
    extra = meter.peak_mb()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    res = {"seconds": seconds, "extra_mb": extra, "peak_rss_mb": hwm / 1024, "values": values,
           "threads": torch.get_num_threads()}
    if on_gpu:
        res["gpu_peak_mb"] = (torch.cuda.max_memory_allocated(device) - gpu_base) / 2 ** 20
    if phases is not None:
        res["phases"] = phases
    worker_reply(res)


def run_providers(args, device: str, n: int, threads: int) -> dict:
    """{provider: its worker's reply, with the load average before and after} for one N and
    thread count, each provider in a fresh process."""
    results = {}
    for provider in args.providers:
        spec = {"provider": provider, "N": n, "D": args.D, "classes": args.classes,
                "device": device, "threads": threads, "phases": args.phases}
        before = loadavg()
        try:
            res = run_isolated(os.path.abspath(__file__), spec, timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout is a result too
            res = {"error": f"{type(exc).__name__}: {exc}"}
        res["load_before"], res["load_after"] = before, loadavg()
        results[provider] = res
    return results


def write_rows(writer, results: dict, common: dict, name: str, cpu_name: str) -> None:
    """One CSV row per provider of :func:`run_providers` (``common``: the columns they share),
    its values compared with PML's."""
    pml = results.get("pml", {}).get("values")
    for provider, res in results.items():
        values = res.get("values") or {}
        # the threads the worker ran with, as it read them (the requested count when it failed)
        row = dict(common, provider=provider, error=res.get("error", ""),
                   load_before=res["load_before"], load_after=res["load_after"],
                   device=cpu_name if provider == "pml" else name, date=utc_now())
        row["threads"] = res.get("threads", row["threads"])
        if values:
            # four significant digits: a small N's search can take under 5 ms, which two
            # decimals wrote as 0.00
            row.update({"seconds": f"{res['seconds']:.4g}",
                        "peak_rss_mb": f"{res['peak_rss_mb']:.0f}",
                        "extra_mb": f"{res['extra_mb']:.0f}"})
            if "gpu_peak_mb" in res:
                row["gpu_peak_mb"] = f"{res['gpu_peak_mb']:.0f}"
            row.update({key: f"{secs:.4g}" for key, secs in res.get("phases", {}).items()})
            row.update({m: repr(values[m]) for m in METRICS})
            if pml and provider != "pml":
                diffs = [abs(values[m] - pml[m]) for m in METRICS]
                row["equal_to_pml"] = all(values[m] == pml[m] for m in METRICS)
                row["max_abs_diff"] = f"{max(diffs):.3g}"
        writer.write(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, nargs="+", default=[30000, 150000])
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--providers", nargs="+", default=["nnkloss", "nnkloss-faiss", "pml"],
                    choices=["nnkloss", "nnkloss-faiss", "nnkloss-torch-mm", "pml"])
    ap.add_argument("--device", default="cpu",
                    help="where the nnkloss providers search (cpu, cuda); PML: the CPU")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="run every provider at each of these thread counts (default: torch's "
                         "count in this process)")
    ap.add_argument("--phases", action="store_true",
                    help="split an nnkloss CPU search's seconds into its GEMM, selection and "
                         "finish (columns gemm_s, select_s, finish_s)")
    add_worker_args(ap, timeout=1800.0)
    args = parse_or_work(ap, argv, worker)
    if args is None:
        return 0
    if args.threads is not None and min(args.threads) < 1:
        ap.error(f"--threads: every count must be >= 1, got {args.threads}")

    device = parse_device(ap, args.device)
    name, commit = device_name(device), git_commit()
    cpu_name = device_name(torch.device("cpu"))  # PML's rows: it runs on the CPU
    csv_path = results_path(args.out, device, prefix="eval_")
    for provider in args.providers:
        prepare(provider, str(device))  # the library built once, before any worker's clock
    print(f"device: {name} | torch threads: {torch.get_num_threads()} | commit {commit}")
    print(f"writing {csv_path}")
    with ResultsCsv(csv_path, COLUMNS) as writer:
        for n in args.N:
            for threads in args.threads or [torch.get_num_threads()]:
                common = {"N": n, "D": args.D, "classes": args.classes,
                          "search_k": n // args.classes - 1, "threads": threads,
                          "commit": commit}
                write_rows(writer, run_providers(args, str(device), n, threads), common, name,
                           cpu_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
