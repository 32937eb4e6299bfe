"""Neighbour-list build time: kNN of all N centres against themselves (exclude_self), per backend.

This is the search half of a centre refresh (``CentreBank.rebuild_neighbours``): an exact
N x N-pair search done in tiles, O(N^2 D) work.

    python benchmarks/bench_refresh.py                                # full grid, 120 s guard
    python benchmarks/bench_refresh.py --N 10000 --D 128 512 --backends torch
    python benchmarks/bench_refresh.py --max-seconds 30 --backends torch faiss faiss-ivf

Grid: N in {1e4, 1e5, 1e6} x D in {128, 512, 2048}, k = 100, backends "torch" and "faiss"
(exact; the ones installed), optionally "faiss-ivf" / "faiss-hnsw" (approximate, default
parameters). Before each shape the time is predicted from the largest shape already measured
for that backend and D (at first a 4096-row calibration run), scaled by N^2 (by N log N for
HNSW); shapes predicted to exceed
``--max-seconds``, or whose data would not fit in memory, are skipped and reported, not run.

The limit: the search is an N x N x D GEMM, so its floor is ``sgemm_seconds`` = 2 N^2 D flops at
the fp32 GEMM rate of this machine, measured in the same run just before each shape (median of
5 products of a (2048, D) by (D, 16384) matrix, the search's own block shape class): the faster
of ``torch.mm`` and, on the CPU, the search's own GEMM where the compiled library has one
(``nnkloss.bank.search.torch_search.distance_tile``; column ``gemm`` names the one that set the
bound, ``torch_mm_gflops`` is torch.mm's rate either way).
``x_sgemm`` = seconds / sgemm_seconds. The "torch" backend on the CPU with the compiled library
searches the one tensor against itself with the symmetric self-search (each pair's distance
computed once: about N^2 D flops, half the bound's), so its x_sgemm can be below 1; the bound
keeps the N x N GEMM so that every backend is on one scale.

Appends one row per measured shape to ``benchmarks/results/refresh_<device>.csv`` with columns
``op,backend,N,D,k,seconds,device,commit,date,sgemm_gflops,sgemm_seconds,x_sgemm,load,gemm,
torch_mm_gflops``
(device: the CUDA device name or the CPU model from /proc/cpuinfo; commit: ``git rev-parse
--short HEAD``; date: UTC ISO 8601; load: the 1-minute load average before the run, from
/proc/loadavg: the machine may be shared). Rows of earlier versions have the columns they
predate empty (before 2026-11-27 the bound was torch.mm's rate).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (ResultsCsv, device_name, git_commit, parse_device,  # noqa: E402
                    results_path, utc_now)

import torch  # noqa: E402

from nnkloss.bank.search import faiss_available, faiss_gpu_usable, knn  # noqa: E402
from nnkloss.bank.search import torch_search as TS  # noqa: E402

COLUMNS = ["op", "backend", "N", "D", "k", "seconds", "device", "commit", "date",
           "sgemm_gflops", "sgemm_seconds", "x_sgemm", "load", "gemm", "torch_mm_gflops"]
APPROX = {"faiss-ivf": "ivf", "faiss-hnsw": "hnsw"}
CALIBRATION_N = 4096


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def label(backend: str, device: torch.device) -> str:
    """The backend as it actually runs: faiss says whether its index is on the GPU or CPU; the
    torch search says when its CPU tiles are computed by torch.mm (--torch-mm) instead of the
    compiled library's GEMM."""
    if backend == "torch":
        return "torch" if TS.COMPILED_GEMM or device.type != "cpu" else "torch (torch.mm)"
    gpu = device.type == "cuda" and faiss_gpu_usable(
        torch.cuda.current_device() if device.index is None else device.index)
    if backend == "faiss-hnsw":
        gpu = False
    return f"{backend}-{'gpu' if gpu else 'cpu'}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_graph(x: torch.Tensor, k: int, backend: str) -> float:
    sync(x.device)
    t0 = time.perf_counter()
    if backend in APPROX:
        knn(x, x, k, exclude_self=True, approximate=APPROX[backend])
    else:
        knn(x, x, k, search_backend=backend, exclude_self=True)
    sync(x.device)
    return time.perf_counter() - t0


def gemm_rates(d: int, device: torch.device, reps: int = 5) -> dict:
    """fp32 GEMM rates (GFLOP/s) of this machine now, median of ``reps`` (2048, d) x (d, 16384)
    products: "torch.mm", and on the CPU "library" (the search's distance_tile with the
    compiled library's GEMM) where the library has one."""
    g = torch.Generator(device="cpu").manual_seed(2)
    a = torch.randn(2048, d, generator=g).to(device)
    b = torch.randn(16384, d, generator=g).to(device)
    out = torch.empty(2048, 16384, device=device)
    products = {"torch.mm": lambda: torch.mm(a, b.t(), out=out)}
    if device.type == "cpu" and TS.COMPILED_GEMM:
        from nnkloss import cpu
        threads = torch.get_num_threads()
        if cpu.gemm_nt(a, b, out, threads):  # also the warm-up
            products["library"] = lambda: cpu.gemm_nt(a, b, out, threads)
    rates = {}
    for name, product in products.items():
        product()  # warm-up
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            product()
            sync(device)
            times.append(time.perf_counter() - t0)
        rates[name] = 2 * 2048 * 16384 * d / sorted(times)[reps // 2] / 1e9
    return rates


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return ""


def data(n: int, d: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(n, d, generator=g).to(device)


def predict(known: tuple, backend: str, n: int) -> float:
    """Scale the largest run so far (n0, seconds) of this backend and D up to n rows."""
    n0, s0 = known
    ratio = n / n0
    if backend == "faiss-hnsw":
        return s0 * ratio * max(1.0, math.log(n) / math.log(n0))
    return s0 * ratio * ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    ap.add_argument("--D", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="torch, faiss, faiss-ivf, faiss-hnsw (default: torch + faiss if present)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="skip shapes predicted to take longer than this (per backend)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--torch-mm", action="store_true",
                    help="the torch search's CPU tiles by torch.mm, not the compiled library's "
                         "GEMM (torch_search.COMPILED_GEMM = False): the A/B of the two")
    args = ap.parse_args(argv)
    if args.torch_mm:
        TS.COMPILED_GEMM = False

    device = parse_device(ap, args.device)
    backends = args.backends or (["torch", "faiss"] if faiss_available() else ["torch"])
    for b in backends:
        if b not in ("torch", "faiss", *APPROX):
            ap.error(f"unknown backend {b!r}")
        if b != "torch" and not faiss_available():
            ap.error(f"backend {b!r} needs faiss, which is not installed")
    name = device_name(device)
    csv_path = results_path(args.out, device, prefix="refresh_")
    commit = git_commit()
    print(f"device: {name} | torch threads: {torch.get_num_threads()} | commit {commit}")
    print(f"writing {csv_path}")

    with ResultsCsv(csv_path, COLUMNS) as writer:
        for d in args.D:
            for backend in backends:
                small = data(CALIBRATION_N, d, device, seed=1)
                # The second of two calls: the first pays the backend's one-time start (CUDA
                # context, cuBLAS handles, faiss resources), which would inflate every guess
                # by (N / CALIBRATION_N) ** 2.
                build_graph(small, args.k, backend)
                calib = build_graph(small, args.k, backend)
                # Small runs carry fixed overheads, so later guesses scale from the largest
                # shape measured so far (conservative: per-pair cost falls with N).
                known = (CALIBRATION_N, calib)
                for n in sorted(int(v) for v in args.N):
                    tag = f"{label(backend, device):>15} N={n:>8} D={d:>5} k={args.k}"
                    need = n * d * 4 * (3 if backend != "torch" else 2)  # data + index copies
                    if need > 0.6 * available_bytes(device):
                        print(f"{tag}: skipped (needs ~{need / 2**30:.1f} GiB)")
                        continue
                    guess = predict(known, backend, n)
                    if guess > args.max_seconds:
                        print(f"{tag}: skipped (predicted {guess:.0f} s > --max-seconds "
                              f"{args.max_seconds:g})")
                        continue
                    x = data(n, d, device)
                    load = loadavg()
                    rates = gemm_rates(d, device)
                    gemm = max(rates, key=rates.get)
                    rate = rates[gemm]
                    floor = 2.0 * n * n * d / rate / 1e9
                    seconds = build_graph(x, args.k, backend)
                    del x
                    known = (n, seconds)
                    writer.write({
                        "op": "knn_graph", "backend": label(backend, device), "N": n, "D": d,
                        # six significant digits: a small graph can take under 50 us,
                        # which four decimals would write as 0.0000
                        "k": args.k, "seconds": f"{seconds:.6g}", "device": name,
                        "commit": commit, "date": utc_now(), "sgemm_gflops": f"{rate:.1f}",
                        "sgemm_seconds": f"{floor:.3f}", "x_sgemm": f"{seconds / floor:.2f}",
                        "load": load, "gemm": gemm,
                        "torch_mm_gflops": f"{rates['torch.mm']:.1f}",
                    }, echo=False)
                    print(f"{tag}: {seconds:8.2f} s (predicted {guess:.1f} s; sgemm bound "
                          f"{floor:.2f} s at {rate:.0f} GFLOP/s ({gemm}; torch.mm "
                          f"{rates['torch.mm']:.0f}): x{seconds / floor:.2f}; "
                          f"load {load})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
