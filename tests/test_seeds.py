"""nnkloss/experiment/seeds.py: a user's seed names one stream, and no two seeds (or derived
keys) share one: out-of-range seeds are refused by name instead of wrapping modulo 2**32."""
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from nnkloss.experiment.datasets import IndexedTensorDataset, stratified_split
from nnkloss.experiment.models import SoftmaxHead
from nnkloss.experiment.train import Trainer, seed_everything


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.mark.parametrize("bad", [-1, 2 ** 32, 2 ** 40, 1.5, True, "3"])
def test_seeds_outside_the_range_are_refused_by_name(bad):
    """seed_everything took int(seed) % 2**32: seed -1 was seed 2**32 - 1 and 2**32 was 0."""
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        seed_everything(bad)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        Trainer(torch.nn.Linear(2, 2), SoftmaxHead(2, 2), [], seed=bad, progress=False)


def test_in_range_seeds_seed_as_before():
    seed_everything(2 ** 32 - 1)
    a = _draws()
    random.seed(2 ** 32 - 1)
    np.random.seed(2 ** 32 - 1)
    torch.manual_seed(2 ** 32 - 1)
    assert a == _draws()


def test_derived_streams_do_not_collide():
    """The Trainer's per-epoch seed was seed * 1_000_003 + epoch + 1_000_000_007 * rank mod
    2**32: seed s on rank 1 had the streams of seed s + 482453229 on rank 0, every epoch."""
    other = (1_000_000_007 * pow(1_000_003, -1, 2 ** 32)) % 2 ** 32
    assert other == 482453229
    seed_everything(5, 3, 1)
    a = _draws()
    seed_everything(5 + other, 3, 0)
    b = _draws()
    seed_everything(5, 3, 1)
    assert _draws() == a  # repeatable
    for x, y in zip(a, b):
        assert x != y
    keys = [(5,), (5, 0), (5, 0, 0), (5, 3, 0), (5, 0, 3), (3, 5, 0)]
    seen = set()
    for key in keys:
        seed_everything(*key)
        seen.add(tuple(_draws()[2]))
    assert len(seen) == len(keys)
    with pytest.raises(ValueError, match=r"stream part 0 must be an integer in \[0, 2\*\*32\)"):
        seed_everything(5, -1)


def test_the_trainer_seeds_each_epoch_and_rank_its_own_stream(monkeypatch):
    import nnkloss.experiment.train as train_mod
    x = torch.randn(16, 4)
    y = torch.arange(16) % 2
    seeds = []

    def run(seed, rank):
        monkeypatch.setattr(train_mod._dist, "rank", lambda: rank)
        tr = Trainer(torch.nn.Linear(4, 3), SoftmaxHead(3, 2),
                     DataLoader(IndexedTensorDataset(x, y), batch_size=8, shuffle=True),
                     optimizer="sgd", lr=0.01, seed=seed, progress=False,
                     eval_fn=lambda m, c, e: seeds.append((seed, rank, e, torch.initial_seed())))
        tr.fit(2)

    run(5, 1)
    run(5 + 482453229, 0)
    run(5, 0)
    assert len({s for *_, s in seeds}) == len(seeds) == 6
    # rank 0 (a single process) keeps the streams the published runs trained with
    for seed, rank, epoch, initial in seeds:
        if rank == 0:
            assert initial == (seed * 1_000_003 + epoch) % 2 ** 32


def test_split_seed_is_checked_by_name():
    """np.random.default_rng(-1) raised "expected non-negative integer", naming nothing."""
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        stratified_split([0, 0, 1, 1], (0.5, 0.5), seed=-1)
    assert [p.tolist() for p in stratified_split([0, 0, 1, 1], (0.5, 0.5), seed=7)] == \
        [p.tolist() for p in stratified_split([0, 0, 1, 1], (0.5, 0.5), seed=7)]
