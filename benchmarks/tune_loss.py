"""Sweep launch configurations of the fused forward kernel and report the best per shape.

    python benchmarks/tune_loss.py                         # default shapes, current CUDA device
    python benchmarks/tune_loss.py --B 4096 --K 100 --D 512 --dtype bf16
    TRITON_INTERPRET=1 python benchmarks/tune_loss.py --device cpu --B 2 --K 5 --D 8 --N 50

Every configuration's outputs are checked against the default configuration's before its time
counts (a wrong fast config is reported as ok=0 and never chosen). Rows go to
``benchmarks/results/tune_<device>.csv`` with columns ``B,K,D,dtype,block_k,block_d,
num_warps,num_stages,ms,gbps,ok,default_ms,device,commit,build,timer,prefetch_index``:
- build: "train", the forward that computes grad_x and stores the distances, or "fwd", the
  forward-only build of ``--forward-only``;
- timer: "graph", the kernel's device time with the host taken out (common.kernel_ms, the
  default), or "do_bench", triton's do_bench, whose figure of a short kernel can be the host's
  launch time instead (``--timer do_bench``);
- prefetch_index: 1 for the one row per shape that times the default's tile with
  ``FwdConfig.prefetch_index`` (the next tile's list entries loaded during each tile).

A file written before those columns existed gets them ("train", "do_bench" and 0). The last
lines printed are the best configuration per shape against the default heuristic
(kernels.default_config).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_loss import DTYPES, bytes_needed, make_inputs, time_ms  # noqa: E402
from common import (device_name, git_commit, kernel_ms, migrate_csv,  # noqa: E402
                    parse_device)
from nnkloss.ops.backends import kernels as _kernels  # noqa: E402

COLUMNS = ["B", "K", "D", "dtype", "block_k", "block_d", "num_warps", "num_stages", "ms", "gbps",
           "ok", "default_ms", "device", "commit", "build", "timer", "prefetch_index"]
# What the columns added since the first files were filled with in older rows: every row before
# the build column was the training forward, every row before the timer column do_bench's, and
# no row before the prefetch_index column prefetched.
_ADDED = {"build": "train", "timer": "do_bench", "prefetch_index": "0"}


def candidate_configs(K, D, FwdConfig, warps=(4, 8), stages=(2,), max_tile=16384,
                      max_thread_elems=128):
    """Power-of-two tiles: the whole row (single pass) when it fits, else D chunks (two-phase).
    None holds more than ``max_thread_elems`` elements a thread: on an H100 the 128-row
    one-warp tile at D 64 (256 a thread) spilled, took 2x the 128-element tile's time and was
    the slowest to compile (tune at 0646941)."""
    full = 1 << max(0, (D - 1).bit_length())
    # The single pass over the whole row first: --max-configs then tries it before D chunks.
    block_ds = sorted({bd for bd in (full, 256, 512, 1024, 2048) if bd <= full and bd <= 8192},
                      reverse=True)
    kp2 = max(1, 1 << (K - 1).bit_length())
    block_ks = [bk for bk in (1, 2, 4, 8, 16, 32, 64, 128) if bk <= kp2]
    for bd, bk, nw, ns in itertools.product(block_ds, block_ks, warps, stages):
        if bk * bd <= max_tile and bk * bd <= max_thread_elems * 32 * nw:
            yield FwdConfig(bk, bd, nw, ns)


def _upgrade(path):
    """Add the columns a results file was written without (_ADDED, in order), atomically
    (common.migrate_csv); a file of any other columns is refused."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if not header or header == COLUMNS:
        return
    if header != COLUMNS[:len(header)] or not set(COLUMNS[len(header):]) <= set(_ADDED):
        raise ValueError(f"{path}: unexpected columns {header}")
    migrate_csv(path, COLUMNS, _ADDED)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--K", type=int, nargs="+", default=[32, 100, 256])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--N", type=int, default=1_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50, help="do_bench rep time in ms (CUDA)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--max-configs", type=int, default=0, help="try at most this many (0: all)")
    ap.add_argument("--forward-only", action="store_true",
                    help="sweep the forward-only build (no grad_x, no distances stored: "
                         "evaluation, no_grad, the classifier) instead of the training forward")
    ap.add_argument("--timer", default="graph", choices=["graph", "do_bench"],
                    help="graph: the kernel's device time, the host taken out (CUDA graphs, "
                         "common.kernel_ms); do_bench: triton's do_bench (host launch included "
                         "where it outlasts the L2 flush)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    timer = kernel_ms if args.timer == "graph" else time_ms
    train = not args.forward_only
    kernels = _kernels()
    device = parse_device(ap, args.device)
    name, commit = device_name(device), git_commit()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".csv")
    new = not os.path.exists(path)
    if not new:
        _upgrade(path)
    summary = []
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        for dt, B, K, D in itertools.product(args.dtype, args.B, args.K, args.D):
            emb, labels, centres, cl, nb, wts, sigma = make_inputs(B, K, D, args.N, DTYPES[dt],
                                                                   device)
            run = lambda cfg=None: kernels.neighbour_kernel_fwd(  # noqa: E731
                emb, labels, centres, cl, nb, wts, sigma, config=cfg, store_dist=train,
                need_grad_x=train)
            ref = run()
            default_ms = timer(run, device, args.reps)
            nbytes = bytes_needed(B, K, D, DTYPES[dt], nb.dtype, "fwd")
            # the launcher's own default for this bank and build
            default = kernels.default_config(
                K, D, elem_size=centres.element_size(), grad_x=train, B=B,
                sms=kernels.neighbour_kernel.sm_count(centres.device))
            best = (default_ms, default)
            configs = list(candidate_configs(K, D, kernels.FwdConfig, args.warps, args.stages))
            if args.max_configs:
                configs = configs[:args.max_configs]
            # The default's tile with the next tile's list entries loaded during each tile
            # (FwdConfig.prefetch_index, off by default until a GPU has timed it): every sweep.
            configs.append(dataclasses.replace(default, prefetch_index=True))
            rows = []
            for cfg in configs:
                try:
                    out = run(cfg)
                    ok = all(torch.allclose(a, r, rtol=1e-4, atol=1e-4, equal_nan=True)
                             for a, r in zip(out, ref))
                    ms = timer(lambda: run(cfg), device, args.reps) if ok else float("nan")
                except Exception as exc:  # a config the compiler rejects (registers, smem)
                    print(f"config {cfg} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    ok, ms = False, float("nan")
                rows.append((cfg, [B, K, D, dt, cfg.block_k, cfg.block_d, cfg.num_warps,
                                   cfg.num_stages, f"{ms:.4g}", f"{nbytes / ms / 1e6:.4g}",
                                   int(ok)]))
                if ok and ms < best[0]:
                    best = (ms, cfg)
            # The default again after the sweep, the faster of its two times kept: the first
            # call of a shape can meet cold clocks and caches, which would flatter the sweep.
            default_ms = min(default_ms, timer(run, device, args.reps))
            if best[0] > default_ms or best[1] == default:
                best = (default_ms, default)
            w.writerows(r + [f"{default_ms:.4g}", name, commit, "train" if train else "fwd",
                             args.timer, int(cfg.prefetch_index)] for cfg, r in rows)
            f.flush()
            summary.append((B, K, D, dt, default_ms, best[0], best[1]))
    print(f"device {name} @ {commit}; rows in {path}")
    for B, K, D, dt, d_ms, b_ms, cfg in summary:
        print(f"B={B} K={K} D={D} {dt} {'training' if train else 'forward-only'}: "
              f"default {d_ms:.4g} ms -> best {b_ms:.4g} ms "
              f"({d_ms / b_ms:.2f}x) with {cfg}")
    return path, summary


if __name__ == "__main__":
    main()
