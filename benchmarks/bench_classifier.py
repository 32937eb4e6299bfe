"""The kernel classifier's distances: one operation, three providers, time and memory.

The operation is what ``NeighbourKernelClassifier`` computes for every batch of queries
(nnkloss/evaluation/classifier.py, ``_sq_dist_minus_ref``): for Q queries, each with a list
of k bank rows and a reference row (its nearest), the (Q, k) ``(c_i - c_r) . (c_i + c_r - 2x)``
in fp32. It has no gradient, so the table's only mode is the forward. Providers:

- ``fused``: what the classifier runs: the compiled library's pass on CPU tensors
  (``nnkloss.cpu.rel_sqdist``), the Triton kernel on CUDA tensors
  (``nnkloss.kernels.rel_sqdist``);
- ``torch``: the classifier's torch form (gathered (rows, k, D) blocks of at most 16 MiB), what
  runs where no fused pass does;
- ``compile``: the same formula as a user would write it, one gather of (Q, k, D), under
  ``torch.compile`` (compiled before the clock starts).

    python benchmarks/bench_classifier.py                  # the three shapes below, CPU
    python benchmarks/bench_classifier.py --device cuda    # on a GPU

Each (shape, provider) runs in a fresh process, on torch's threads: peak memory of its first
call above the RSS
before it (CPU; ``torch.cuda.max_memory_allocated`` on a GPU), then the median time of the
calls (``common.time_ms``), and on a GPU the kernels alone (``common.graph_ms``);
``--rounds`` such processes per provider, the providers taking turns, the median round kept
(all rounds in the note; peak memory: the largest). The read share is the bytes of the
gathered rows (Q x k x D x 4) over each time against the machine's sequential read
(``common.read_gbps``: on CPU in each measuring process, before and after its calls, the
larger kept; on a GPU the main process's, before each shape). One row per (shape, provider)
in ``benchmarks/results/classifier_<device>.csv`` (``common.TABLE_COLUMNS``, pass "forward").
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (PeakMemory, add_worker_args, command_line, device_name,  # noqa: E402
                    git_commit, graph_ms, load_average, median_round, parse_device, parse_or_work,
                    read_gbps, run_isolated, table_csv, table_row, time_ms, worker_reply)

import torch  # noqa: E402

PROVIDERS = ["fused", "torch", "compile"]
# (Q queries, k per list, D, N bank rows): the Fashion-MNIST protocol's classifier (2,000-query
# slices of its 10,000 test images against 20,000 training embeddings, k 1000, D 64), an
# evaluation-like batch, and wide rows.
SHAPES = ["2000,1000,64,20000", "8192,100,128,50000", "512,256,512,50000"]



def setup(Q: int, k: int, D: int, N: int, device):
    """Queries, bank, lists and reference rows of one shape (seeded, fp32, int64)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(N, D, generator=g)
    x = torch.randn(Q, D, generator=g)
    idx = torch.randint(0, N, (Q, k), generator=g)
    ref = idx[:, 0].clone()
    return tuple(t.to(device) for t in (x, centres, idx, ref))


def user_form(x, centres, idx, ref):
    """The formula in one piece, as a user would write it: a (Q, k, D) gather."""
    c = centres[idx]
    r = centres[ref][:, None, :]
    return ((c - r) * (c + r - 2.0 * x[:, None, :])).sum(-1)


def provider_fn(provider: str):
    """The provider's function of (x, centres, idx, ref) -> (Q, k) fp32."""
    from nnkloss.evaluation import classifier
    if provider == "fused":
        def fused(x, centres, idx, ref):
            out = classifier._fused_rel_sqdist(x, centres, idx, ref, torch.float32)
            if out is None:
                raise RuntimeError("no fused pass on this device (no compiler / no triton)")
            return out
        return fused
    if provider == "torch":
        return lambda x, centres, idx, ref: classifier._torch_rel_sqdist(x, centres, idx, ref,
                                                                         torch.float32)
    if provider == "compile":
        return torch.compile(user_form, dynamic=False)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def worker(spec: dict) -> None:
    """One provider and shape in this (fresh) process."""
    device = torch.device(spec["device"])
    args = setup(*spec["shape"], device)
    fn = provider_fn(spec["provider"])
    fn(*args)  # before the measurements: compile, build or load the library, JIT the kernel
    cpu = device.type == "cpu"
    reads = [read_gbps(device, spec["read_bytes"])] if cpu else []
    meter = PeakMemory(device).start()
    fn(*args)
    peak = meter.peak_mb()
    ms = time_ms(lambda: fn(*args), device, warmup=1, iters=spec["iters"])
    kernel = None if cpu else graph_ms(lambda: fn(*args), device)
    if cpu:
        reads.append(read_gbps(device, spec["read_bytes"]))
    worker_reply({"ms": ms, "kernel_ms": kernel, "peak_mb": peak,
                  "read_gbps": max(reads, default=None)})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="Q,k,D,N")
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--iters", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=3,
                    help="fresh processes per provider and shape, the providers in turn")
    ap.add_argument("--read-bytes", type=int, default=2 ** 30,
                    help="size of the sequential read that gives the read limit")
    add_worker_args(ap, timeout=900.0)
    args = parse_or_work(ap, argv, worker)
    if args is None:
        return 0

    device = parse_device(ap, args.device)
    name, commit = device_name(device), git_commit()
    command = command_line(__file__, argv)
    print(f"device: {name} | torch threads: {torch.get_num_threads()} | commit {commit}")
    with table_csv(args.out, "classifier", device) as out:
        print(f"writing {out.path}")
        for text in args.shapes:
            Q, k, D, N = (int(v) for v in text.split(","))
            # on a GPU the read share is held against this read (the workers take none there)
            main_read = read_gbps(device, args.read_bytes) if device.type != "cpu" else None
            runs = {p: [] for p in args.providers}
            loads = {p: [] for p in args.providers}
            for _ in range(args.rounds):  # the providers take turns, a fresh process each
                for provider in args.providers:
                    spec = {"provider": provider, "shape": [Q, k, D, N],
                            "device": str(device), "iters": args.iters,
                            "read_bytes": args.read_bytes}
                    loads[provider].append(load_average().split(" ")[0])
                    runs[provider].append(run_isolated(os.path.abspath(__file__), spec,
                                                       timeout=args.timeout))
            for provider in args.providers:
                row = ("classifier distances", provider, "forward", f"Q={Q} k={k} D={D} N={N}",
                       "fp32")
                errors = [r["error"] for r in runs[provider] if "error" in r]
                if errors:
                    row = table_row(*row, note=errors[0])
                else:
                    med = median_round(runs[provider], key=lambda r: r["ms"])
                    ms = " ".join(f"{r['ms']:.3f}" for r in runs[provider])
                    row = table_row(*row, wall_ms=med["ms"], kernel_ms=med["kernel_ms"],
                                    peak_mb=max(r["peak_mb"] for r in runs[provider]),
                                    read_bytes=Q * k * D * 4,
                                    read_gbps=med["read_gbps"] or main_read,
                                    note=f"rounds {ms}; load {' '.join(loads[provider])}")
                row.update(threads=torch.get_num_threads(), device=name, commit=commit,
                           command=command)
                out.write(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
