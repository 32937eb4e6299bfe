"""The module's host cost against the autograd floor, side by side in one process.

One step of ``NeighbourKernelLoss(bank)(emb, labels, idx)`` forward+backward (value checks
off, default backend) is timed against ``(x * 1).sum().backward()``, the cheapest step autograd
can take, alternating the two and keeping the best of several rounds (a shared machine is
noisy). The ratio is what the road from the module to its kernel costs beyond autograd's own.

    PYTHONPATH=. python benchmarks/host_ratio.py --B 32 --K 8 --D 16
"""
from __future__ import annotations

import argparse
import time

import torch

import nnkloss


def module_step(B: int = 32, K: int = 8, D: int = 16, N: int = 256, device="cpu"):
    """A closure running one forward+backward of the module on a random bank."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(N, D, generator=g)
    bank = nnkloss.CentreBank(centres, torch.arange(N) % 10,
                              neighbours=torch.randint(0, N, (N, K), generator=g)).to(device)
    loss_fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0)
    idx = torch.randperm(N, generator=g)[:B].to(device)
    x = centres[idx.cpu()].to(device).requires_grad_(True)
    labels = bank.centre_labels[idx]

    def step():
        x.grad = None
        loss_fn(x, labels, idx).backward()
    return step


def floor_step(B: int = 32, D: int = 16, device="cpu"):
    x = torch.randn(B, D, device=device, requires_grad=True)

    def step():
        x.grad = None
        (x * 1).sum().backward()
    return step


def _best(step, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t0) / calls


def host_ratio(B: int = 32, K: int = 8, D: int = 16, rounds: int = 7, calls: int = 200):
    """``(module_s, floor_s)``: the best per-step seconds of each over ``rounds`` alternated
    rounds of ``calls`` steps, value checks off."""
    module, floor = module_step(B, K, D), floor_step(B, D)
    best_m = best_f = float("inf")
    with nnkloss.value_checks(False):
        for step in (module, floor):
            _best(step, 20)  # warm-up: builds, caches
        for _ in range(rounds):
            best_m = min(best_m, _best(module, calls))
            best_f = min(best_f, _best(floor, calls))
    return best_m, best_f


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=32)
    p.add_argument("--K", type=int, default=8)
    p.add_argument("--D", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    m, f = host_ratio(a.B, a.K, a.D, a.rounds, a.calls)
    print(f"module {m * 1e6:.1f} us, floor {f * 1e6:.1f} us, ratio {m / f:.2f}x "
          f"(B {a.B}, K {a.K}, D {a.D}, value checks off, best of {a.rounds} rounds)")


if __name__ == "__main__":
    main()
