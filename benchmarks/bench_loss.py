"""Microbenchmark of the neighbour-kernel loss: fused Triton op vs eager PyTorch vs torch.compile.

    python benchmarks/bench_loss.py                      # full grid on the current CUDA device
    python benchmarks/bench_loss.py --B 1024 --K 100 --D 512 --dtype bf16
    python benchmarks/bench_loss.py --device cpu --B 8 --K 4 --D 16 --N 100   # smoke run

Appends one row per (provider, mode, shape) to ``benchmarks/results/<device>.csv`` with columns
``op,provider,mode,B,K,D,dtype,ms,gbps,peak_mem_mb,device,commit`` and draws
``benchmarks/results/<device>.png`` (time and GB/s per shape). ``gbps`` counts the bytes the op
must read (DESIGN.md section 2): the gathered centres ``B*K*D*sizeof(bank)`` plus the index,
label and weight traffic and the embeddings, whatever the provider actually moves, so the
providers compare on one scale. A row that ran out of memory is written with ms = "oom".
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import nnkloss  # noqa: E402
from common import device_name, git_commit  # noqa: E402

COLUMNS = ["op", "provider", "mode", "B", "K", "D", "dtype", "ms", "gbps", "peak_mem_mb",
           "device", "commit"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def eager_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    """The loss the way a user would write it in PyTorch: gather (B, K, D), then logsumexp."""
    valid = neighbours >= 0
    safe = neighbours.clamp_min(0)
    c = centres[safe].float()                                   # (B, K, D)
    d = ((emb.float()[:, None, :] - c) ** 2).sum(-1)
    logits = torch.log(weights[safe]) - d / (2 * sigma * sigma)
    logits = logits.masked_fill(~valid, float("-inf"))
    same = valid & (centre_labels[safe] == labels[:, None])
    lse = torch.logsumexp(logits, 1)
    lse_pos = torch.logsumexp(logits.masked_fill(~same, float("-inf")), 1)
    ok = torch.isfinite(lse_pos)
    rows = torch.where(ok, lse - lse_pos, torch.zeros_like(lse))
    return rows.sum() / ok.sum().clamp_min(1)


def fused_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    return nnkloss.neighbour_kernel_loss(emb, labels, centres, centre_labels, neighbours,
                                         weights, sigma)


def bytes_needed(B, K, D, bank_dtype, idx_dtype, mode):
    """Bytes the op must move: gathered centres + index/label/weight gathers + embeddings."""
    esize = torch.tensor([], dtype=bank_dtype).element_size()
    isize = torch.tensor([], dtype=idx_dtype).element_size()
    per_entry = isize + 8 + 4  # index, centre label (int64), weight (fp32)
    total = B * K * (D * esize + per_entry) + B * D * 4 + B * 8
    if mode == "fwd_bwd":
        total += B * D * 4  # the embedding gradient written
    return total


def make_inputs(B, K, D, N, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    centres = torch.randn(N, D, generator=g).to(device=device, dtype=dtype)
    centre_labels = torch.randint(0, 100, (N,), generator=g).to(device)
    idx = torch.randint(0, N, (B,), generator=g).to(device)
    # Neighbours: random bank rows, with the query's own class guaranteed in the first entry.
    nb = torch.randint(0, N, (B, K), generator=g).to(device)
    emb = (centres[idx].float() + 0.1 * torch.randn(B, D, generator=g).to(device))
    labels = centre_labels[idx]
    nb[:, 0] = idx
    weights = torch.ones(N, device=device)
    sigma = torch.tensor(float(D) ** 0.5 * 0.5, device=device)
    return emb, labels, centres, centre_labels, nb, weights, sigma


def time_ms(fn, device, reps):
    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=reps, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def run_one(provider, mode, inputs, device, reps):
    emb, labels, centres, cl, nb, w, sigma = inputs
    fn = {"fused": fused_loss, "eager": eager_loss}.get(provider)
    if provider == "compile":
        fn = torch.compile(eager_loss, dynamic=False)
    x = emb.detach().clone().requires_grad_(mode == "fwd_bwd")

    def step():
        loss = fn(x, labels, centres, cl, nb, w, sigma)
        if mode == "fwd_bwd":
            x.grad = None
            loss.backward()
        return loss

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        step()  # compile / autotune outside the measured region
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        step()
        peak = float("nan")
    return time_ms(step, device, reps), peak


def measure_copy_gbps(device, nbytes=2 ** 31):
    """Device-to-device copy bandwidth (bytes read + written), the ceiling the targets use."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, 200)
    return 2 * nbytes / ms / 1e6


def plot(csv_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss" and r["ms"] != "oom"]
    if not rows:
        return
    keys = sorted({(r["B"], r["K"], r["D"], r["dtype"], r["mode"]) for r in rows},
                  key=lambda k: (k[4], k[3], int(k[2]), int(k[1]), int(k[0])))
    providers = sorted({r["provider"] for r in rows})
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.35 * len(keys)), 8), sharex=True)
    for p in providers:
        ms, gb = [], []
        for k in keys:
            hit = [r for r in rows if r["provider"] == p and
                   (r["B"], r["K"], r["D"], r["dtype"], r["mode"]) == k]
            ms.append(float(hit[-1]["ms"]) if hit else float("nan"))
            gb.append(float(hit[-1]["gbps"]) if hit else float("nan"))
        axes[0].plot(range(len(keys)), ms, "o-", label=p)
        axes[1].plot(range(len(keys)), gb, "o-", label=p)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms (median)")
    axes[1].set_ylabel("GB/s (bytes the op must read)")
    axes[1].set_xticks(range(len(keys)))
    axes[1].set_xticklabels([f"{m} {dt} B{b} K{k} D{d}" for b, k, d, dt, m in keys],
                            rotation=90, fontsize=7)
    axes[0].legend()
    axes[0].set_title(f"neighbour-kernel loss — {rows[-1]['device']} @ {rows[-1]['commit']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--K", type=int, nargs="+", default=[32, 100, 256])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--N", type=int, default=1_000_000, help="bank rows (default: >> L2)")
    ap.add_argument("--providers", nargs="+", default=["fused", "eager", "compile"],
                    choices=["fused", "eager", "compile"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=100, help="do_bench rep time in ms (CUDA)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--copy-bandwidth", action="store_true",
                    help="also measure device-to-device copy bandwidth (row op=copy)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = device_name(device)
    commit = git_commit()
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    csv_path = os.path.join(args.out, f"{slug}.csv")
    new = not os.path.exists(csv_path)
    # The fused op validates values (one host sync) by default; a training loop turns that off.
    nnkloss.set_value_checks(False)
    with open(csv_path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        if args.copy_bandwidth:
            gbps = measure_copy_gbps(device)
            w.writerow(["copy", "torch", "copy", 0, 0, 0, "fp32", "", f"{gbps:.1f}", "", name,
                        commit])
            print(f"device-to-device copy: {gbps:.1f} GB/s")
        for dt, B, K, D in itertools.product(args.dtype, args.B, args.K, args.D):
            try:
                inputs = make_inputs(B, K, D, args.N, DTYPES[dt], device)
            except torch.OutOfMemoryError:
                print(f"skip B={B} K={K} D={D} {dt}: bank does not fit")
                continue
            for mode, prov in itertools.product(args.modes, args.providers):
                try:
                    ms, peak = run_one(prov, mode, inputs, device, args.reps)
                    gbps = bytes_needed(B, K, D, DTYPES[dt], inputs[4].dtype, mode) / ms / 1e6
                    row = ["loss", prov, mode, B, K, D, dt, f"{ms:.4g}", f"{gbps:.4g}",
                           f"{peak:.1f}", name, commit]
                except torch.OutOfMemoryError:
                    row = ["loss", prov, mode, B, K, D, dt, "oom", "", "", name, commit]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                w.writerow(row)
                f.flush()
                print(",".join(str(v) for v in row), flush=True)
            del inputs
    plot(csv_path, os.path.join(args.out, f"{slug}.png"))
    return csv_path


if __name__ == "__main__":
    main()
