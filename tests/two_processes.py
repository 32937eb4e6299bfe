"""Two CPU processes joined by gloo, for the tests of nnkloss.distributed and nnkloss.bank.exchange.

A test module defines ``worker(rank, port, out_dir)`` at module level (spawned processes import
it by name), which computes its single-process references BEFORE joining the group (so they run
the same numerics on the same thread count), joins with :func:`join`, runs the distributed
versions and ends with :func:`finish`. :func:`run` spawns the two workers and returns what each
saved. A deadline kills the children, so a hang fails fast instead of stalling CI.
"""
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from nnkloss import distributed as nkd

WORLD = 2
DEADLINE_S = 120.0
N = 37  # odd: DistributedSampler pads rank 1 with a repeat of row 0
D_IN, D, CLASSES, K = 6, 4, 12, 3  # many classes, short lists: ensure_positive has work to do


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D_IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g)


def make_model(dropout=True):
    torch.manual_seed(0)
    layers = [nn.Linear(D_IN, 16), nn.ReLU()]
    if dropout:  # the Refresher embeds in eval mode: dropout must not reach the bank
        layers.append(nn.Dropout(0.5))
    return nn.Sequential(*layers, nn.Linear(16, D))


def join(rank: int, port: int) -> None:
    """Join the two-process group as torchrun would (its environment variables)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert nkd.init_from_env(timeout_s=60)
    assert nkd.is_distributed() and nkd.rank() == rank and nkd.world_size() == WORLD
    assert nkd.is_main_process() == (rank == 0)


def finish(results: dict, rank: int, out_dir: str) -> None:
    nkd.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    nkd.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(worker, out_dir: str) -> list:
    """Spawn ``worker`` on WORLD ranks; the per-rank results it saved, rank 0 first."""
    ctx = mp.start_processes(worker, args=(_free_port(), out_dir), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):  # re-raises a child's exception with its traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed workers did not finish within {DEADLINE_S} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


def assert_same(a: dict, b: dict) -> None:
    """Two ranks' results are equal key by key (tensors bit for bit)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
