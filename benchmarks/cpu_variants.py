"""A/B of the compiled CPU kernel's build-time knobs, interleaved in one process.

    python benchmarks/cpu_variants.py -D NNK_PREFETCH_LOCALITY=0 -D NNK_PREFETCH_LOCALITY=3
    python benchmarks/cpu_variants.py -D NNK_ONE_PASS_BYTES=16384 -D "" --rounds 5

Each ``-D`` is one variant: macros of ``nnkloss/ops/cpu_kernel.cpp`` (comma-separated, e.g.
``NNK_PREFETCH_LOCALITY=3,NNK_PREFETCH_BYTES=16384``; ``""`` is the source's defaults). Every
variant is built into a private temporary cache (the same verified build and load as users
get), then for each of ``--rounds`` rounds and each shape of bench_loss's CPU grid the variants
run in turn: the op's forward (embeddings that do not require grad) and forward+backward
(gradient to the embeddings), value checks off, the thread governors off (exactly
``--threads``). Prints one line per (round, variant, shape) with the median of ``--iters``
calls and the gathered rows' GB/s, then each variant's median over the rounds; with ``--out``
the lines also go to a log file headed by device, commit, date and load.

Variants share one process so that the machine's drift (the 2-core VM's memory read moved
1.7x within hours) hits them alike; the rounds show what is left of the noise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import device_name, git_commit, load_average, time_ms, utc_now  # noqa: E402

import torch  # noqa: E402

import nnkloss  # noqa: E402
from bench_loss import CPU_GRID, DTYPES, gathered_bytes, make_inputs  # noqa: E402
from nnkloss.ops import cpu  # noqa: E402


def build(defines: str):
    """The library with ``-D`` flags for the comma-separated ``defines``, in its own private
    cache directory (cpu.py's verified build and load); returns the loaded handle."""
    flags = [f"-D{d.strip()}" for d in defines.split(",") if d.strip()]
    saved = (cpu.FLAGS, os.environ.get("NNKLOSS_CACHE_DIR"))
    cpu.FLAGS = saved[0] + flags
    cache = tempfile.mkdtemp(prefix="nnk_variant_")
    os.environ["NNKLOSS_CACHE_DIR"] = cache
    try:
        cpu._reset_for_tests()
        if not cpu.available():
            raise SystemExit(f"variant {defines!r} did not build: {cpu.build_info()['error']}")
        return cpu._state["lib"]
    finally:
        # loaded through its open descriptor (cpu._load), so the files can go now
        shutil.rmtree(cache, ignore_errors=True)
        cpu.FLAGS = saved[0]
        if saved[1] is None:
            os.environ.pop("NNKLOSS_CACHE_DIR", None)
        else:
            os.environ["NNKLOSS_CACHE_DIR"] = saved[1]


def use(lib) -> None:
    """Make ``lib`` the library the op calls (cpu._lib() returns the loaded handle)."""
    cpu._state["lib"] = lib


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-D", dest="variants", action="append", required=True,
                    help="one variant: comma-separated macros ('' for the defaults)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into CPU_GRID (default all)")
    ap.add_argument("--out", help="also append the lines to this log file")
    args = ap.parse_args(argv)
    os.environ["NNKLOSS_GOVERN_THREADS"] = "0"
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    libs = [(v or "defaults", build(v)) for v in args.variants]
    grid = [CPU_GRID[i] for i in args.shapes] if args.shapes else CPU_GRID
    lines = [f"# {device_name(dev)} | commit {git_commit()} | {utc_now()} | threads "
             f"{args.threads} | load {load_average()}"]
    print(lines[0], flush=True)
    results = {}
    for r in range(args.rounds):
        for (B, K, D, N, dt) in grid:
            emb, labels, centres, cl, nb, w, sigma = make_inputs(B, K, D, N, DTYPES[dt], dev)
            x = emb.clone().requires_grad_(True)
            gb = gathered_bytes(B, K, D, DTYPES[dt]) / 1e6

            def fwd():
                nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma)

            def fwd_bwd():
                x.grad = None
                nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, w, sigma).backward()

            for name, lib in libs:
                use(lib)
                with nnkloss.value_checks(False):
                    ms = [time_ms(f, dev, iters=args.iters) for f in (fwd, fwd_bwd)]
                results.setdefault((name, (B, K, D, dt)), []).append(ms)
                lines.append(f"round {r} | {name} | {B},{K},{D},{dt} | forward {ms[0]:.3f} ms "
                             f"({gb / ms[0]:.1f} GB/s) | forward+backward {ms[1]:.3f} ms "
                             f"({gb / ms[1]:.1f} GB/s)")
                print(lines[-1], flush=True)
    lines.append("# medians over the rounds")
    for (name, shape), runs in results.items():
        f, fb = (statistics.median(m[i] for m in runs) for i in (0, 1))
        lines.append(f"{name} | {','.join(map(str, shape))} | forward {f:.3f} ms | "
                     f"forward+backward {fb:.3f} ms")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
