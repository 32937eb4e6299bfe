"""Where one call of the fused loss spends its time: the host (Python, dispatch, launches) or
the device (kernels), for the forward-only call and a forward+backward step; ``--providers
fused module`` does the same for the module's call (``NeighbourKernelLoss(bank)(emb, labels,
idx)``, bench_loss's module_unchecked: the bank's lists and labels, sigma, the drop of
disagreeing rows, the stats); ``module_torch_lists`` is the same call with the batch's lists
made by torch's ops, as before ``kernels/batch_lists.py`` took them into one launch on CUDA
(the A/B of that launch in one run; on CPU tensors both take the compiled library's passes).

    python benchmarks/profile_step.py --device cuda --B 4096 --K 100 --D 128 --dtype fp32
    python benchmarks/profile_step.py --device cpu --B 8 --K 4 --D 16 --N 100    # smoke run

For each mode it prints:
  * wall ms per call, timed back to back with one synchronisation at the end (what a training
    loop sees), and the host ms per call (the time the Python call takes to return, i.e. to
    enqueue its work; on CUDA a call whose host ms is about its wall ms is host-bound);
  * the host functions with the most own time (cProfile over ``--calls`` calls);
  * on CUDA, the kernels and their device time per call (torch.profiler).
Value checks are off, as in a training loop after its first step (bench_loss does the same).
Nothing is written to disk; the numbers go to stdout with device, commit and date.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import os
import pstats
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import nnkloss  # noqa: E402
from bench_loss import DTYPES, fused_loss, make_inputs, module_loss  # noqa: E402
from common import device_name, git_commit, parse_device, utc_now  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(mode, inputs, loss_fn=fused_loss):
    """One call of ``loss_fn`` (the op, or module_loss's call) in ``mode`` ("fwd": no input
    requires grad; "fwd_bwd": the loss and its backward to the embeddings)."""
    emb, labels, centres, cl, nb, w, sigma = inputs
    x = emb.detach().clone().requires_grad_(mode == "fwd_bwd")

    def step():
        loss = loss_fn(x, labels, centres, cl, nb, w, sigma)
        if mode == "fwd_bwd":
            x.grad = None
            loss.backward()
        return loss
    return step


@contextlib.contextmanager
def lists_route(provider):
    """The module's lists as ``provider`` makes them: module_torch_lists without the one-launch
    kernel (nnkloss.losses.base._lists_kernel answers None), every other provider as is."""
    from nnkloss.losses import base
    real = base._lists_kernel
    if provider == "module_torch_lists":
        base._lists_kernel = lambda device, choice="auto": None
    try:
        yield
    finally:
        base._lists_kernel = real


def wall_and_host_ms(step, device, calls):
    """(wall ms per call with one sync at the end, host ms per call until each returns)."""
    _sync(device)
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter()
        step()
        host += time.perf_counter() - t
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / calls, host * 1e3 / calls


def host_profile(step, device, calls, top):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    _sync(device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def kernel_table(step, device, calls, top):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        _sync(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


class _Identity(torch.autograd.Function):
    """A Python autograd.Function that does nothing: what autograd's engine and a Python
    backward cost on this device, apart from any work."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def part_steps(inputs):
    """``--parts``: (name, step) pairs, each one piece of the op's call on its own, so that the
    host ms of a whole call can be read against its pieces (the Python and launch cost of each
    on this host: on CUDA the forward of B 4096, K 100, D 128 is host-bound, 0.19 ms for an
    0.08 ms kernel on an H200 at ea8736c)."""
    from nnkloss.ops.neighbour_kernel import _forward, reduce_rows
    from nnkloss.ops.reference import counted_rows
    from nnkloss.ops.backends import resolve_backend
    emb, labels, centres, cl, nb, w, sigma = inputs
    backend = resolve_backend("auto", emb.device)
    args = (emb.contiguous(), labels, centres, cl, nb, w, sigma)
    per_row, _, lse_pos, *_ = _forward(*args, backend, False, False, False)
    counted = counted_rows(lse_pos)
    x = emb.detach().clone().requires_grad_()

    def identity_round_trip():
        _Identity.apply(x).sum().backward()

    def torch_round_trip():
        (x * 1).sum().backward()

    return [
        ("one torch op (per_row + 1)", lambda: per_row + 1),
        ("backend forward, forward-only", lambda: _forward(*args, backend, False, False, False)),
        ("backend forward, training (grad_x)",
         lambda: _forward(*args, backend, False, True, False)),
        ("counted rows (lse_pos not -inf)", lambda: counted_rows(lse_pos)),
        ("counted rows, isneginf + logical_not_", lambda: lse_pos.isneginf().logical_not_()),
        # the module's mean comes from the forward's launch (MEAN); these are the torch forms
        ("reduce_rows mean", lambda: reduce_rows(per_row, counted, "mean")),
        ("mean by torch's ops (sum, count_nonzero, clamp_min, div)",
         lambda: per_row.sum() / torch.count_nonzero(counted).clamp_min(1)),
        ("autograd: (x * 1).sum().backward()", torch_round_trip),
        ("autograd: identity Function, .sum().backward()", identity_round_trip),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--B", type=int, default=4096)
    ap.add_argument("--K", type=int, default=100)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--N", type=int, default=1_000_000)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--providers", nargs="+", default=["fused"],
                    choices=["fused", "module", "module_torch_lists"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--parts", action="store_true",
                    help="also time the pieces of the op's call on their own (part_steps)")
    args = ap.parse_args(argv)
    device = parse_device(ap, args.device)
    inputs = make_inputs(args.B, args.K, args.D, args.N, DTYPES[args.dtype], device)
    print(f"device {device_name(device)} | commit {git_commit()} | {utc_now()} | "
          f"B={args.B} K={args.K} D={args.D} N={args.N} {args.dtype}")
    report = {}
    with nnkloss.value_checks(False):
        # the module's bank (its (N, K) lists table) built once, for every mode
        loss_fns = {p: fused_loss if p == "fused" else module_loss(inputs, checks=False)
                    for p in args.providers}
        for provider, mode in itertools.product(args.providers, args.modes):
            step = step_fn(mode, inputs, loss_fns[provider])
            with lists_route(provider):
                for _ in range(3):  # compile, autotune and allocator warm-up
                    step()
                wall, host = wall_and_host_ms(step, device, args.calls)
                key = mode if provider == "fused" else f"{provider} {mode}"
                report[key] = (wall, host)
                print(f"\n== {key}: wall {wall:.4f} ms/call, host {host:.4f} ms/call "
                      f"({100 * host / wall:.0f}% of wall)")
                print(host_profile(step, device, args.calls, args.top))
                if device.type == "cuda":
                    print(kernel_table(step, device, args.calls, args.top))
        if args.parts:
            print("\n== parts (each on its own, back to back)\n| piece | wall ms | host ms |"
                  "\n| --- | --- | --- |")
            for name, step in part_steps(inputs):
                for _ in range(3):
                    step()
                wall, host = wall_and_host_ms(step, device, args.calls)
                report[f"part {name}"] = (wall, host)
                print(f"| {name} | {wall:.4f} | {host:.4f} |")
    return report


if __name__ == "__main__":
    main()
