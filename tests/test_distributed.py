"""nnkloss.distributed: DDP training steps over two gloo processes (tests/two_processes.py), and
the helpers' single-process behaviour.

With global_mean and sync_loss_parameters, two ranks that each take half of a global batch
must take the steps that one process takes with the whole batch, learned sigma and bank
weights included; the Trainer under DDP must match its single-process run.
"""
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nnkloss
from nnkloss import CentreBank, NeighbourKernelLoss, Refresher
from nnkloss import distributed as nkd
from nnkloss.experiment.datasets import IndexedTensorDataset
from two_processes import (CLASSES, D, K, N, WORLD, assert_same as _same, finish, join,
                           make_data, make_model, run)

STEPS, GLOBAL_BATCH = 3, 12
FRESH = dict(fresh_centres=0.5, neighbours_every_steps=2)  # the bank written and re-listed by steps


# ---------------------------------------------------------------------------- training
def fixed_bank():
    """A bank whose lists leave some rows without a positive: per-rank valid counts differ."""
    g = torch.Generator().manual_seed(2)
    centres = torch.randn(N, D, generator=g)
    torch.randint(0, CLASSES, (N,), generator=g)  # (drawn as before: the same weights follow)
    # The data's own labels: the loss refuses a batch whose labels disagree with the bank's.
    bank = CentreBank(centres, make_data()[1], weights=torch.rand(N, generator=g) + 0.5)
    bank.rebuild_neighbours(K, search_backend="torch")
    return bank


def global_batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randperm(N, generator=g)[:GLOBAL_BATCH] for _ in range(STEPS)]


def train(x, y, rows_of_step):
    """STEPS SGD steps; ``rows_of_step(batch)`` picks this process's rows of a global batch.
    Returns the per-step loss as seen by the whole job, counts, and the final parameters."""
    model = make_model(dropout=False)
    bank = fixed_bank()
    bank.learn_weights = True
    crit = NeighbourKernelLoss(bank, sigma=0.8, learn_sigma=True)
    net = nkd.wrap_model(model)
    opt = torch.optim.SGD(list(model.parameters()) + list(crit.parameters()), lr=0.3,
                          momentum=0.9)
    losses, counts = [], []
    for batch in global_batches():
        idx = rows_of_step(batch)
        loss = crit(net(x[idx]), y[idx], idx)
        counts.append(int(crit.last_num_counted))
        loss = nkd.global_mean(loss, crit.last_num_counted)
        opt.zero_grad()
        loss.backward()
        nkd.sync_loss_parameters(crit)
        opt.step()
        seen = loss.detach().clone()
        if nkd.is_distributed():  # the job's loss: the average over ranks of global_mean's
            torch.distributed.all_reduce(seen)
            seen /= nkd.world_size()
        losses.append(float(seen))
    params = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    params["log_sigma"] = crit.log_sigma.detach().clone()
    params["log_weights"] = crit.bank.log_weights.detach().clone()
    return {"losses": losses, "counts": counts, "params": params}


def run_trainer(x, y, out_dir, **options):
    """Two epochs of the Trainer (refresh before the first and after each epoch); the loaders
    are sharded under torch.distributed. 36 rows, global batch 12: unshuffled shards of 6 rows
    per rank make the same global batches as one process, with no sampler padding.
    ``options``: more Trainer options (fresh_centres, neighbours_every_steps, ...)."""
    from nnkloss.experiment.train import Trainer
    ds = IndexedTensorDataset(x[:36], y[:36])
    model = make_model(dropout=False)
    bank = CentreBank(torch.zeros(36, D), torch.zeros(36, dtype=torch.long), learn_weights=True)
    crit = NeighbourKernelLoss(bank, sigma=0.8, learn_sigma=True)
    ordered = nkd.shard_loader(DataLoader(ds, batch_size=10), split_batch=False)
    refresher = Refresher(bank, model, ordered, K, search_backend="torch", progress=False)
    train_loader = nkd.shard_loader(DataLoader(ds, batch_size=GLOBAL_BATCH))
    trainer = Trainer(model, crit, train_loader, optimizer="sgd", lr=0.2, weight_decay=1e-3,
                      refresher=refresher, schedule=nnkloss.RefreshSchedule(every_epochs=1),
                      out_dir=out_dir, progress=False, seed=3, **options)
    history = trainer.fit(2, resume=False)
    params = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    params["log_sigma"] = crit.log_sigma.detach().clone()
    params["log_weights"] = bank.log_weights.detach().clone()
    params["centres"] = bank.centres.clone()
    params["neighbours"] = bank.neighbours.clone()
    return {"history": [{k: r[k] for k in ("loss", "counted_frac", "sigma")} for r in history],
            "params": params, "files": sorted(os.listdir(out_dir))}


# ---------------------------------------------------------------------------- the children
def sync_loss_parameters_cases(rank):
    """(host reads, grad) of sync_loss_parameters: sigma's gradient present on both ranks (no
    read of the presence flags: no host sync per step), on rank 0 only (rank 1's None counts as
    zeros), on neither (stays None)."""
    out = []
    real = torch.Tensor.tolist
    for present in ((0, 1), (0,), ()):
        crit = NeighbourKernelLoss(fixed_bank(), sigma=0.8, learn_sigma=True)
        crit.log_sigma.grad = torch.tensor(2.0 + rank) if rank in present else None
        reads = []
        torch.Tensor.tolist = lambda t: reads.append(1) or real(t)
        try:
            nkd.sync_loss_parameters(crit)
        finally:
            torch.Tensor.tolist = real
        grad = crit.log_sigma.grad
        out.append((len(reads), None if grad is None else float(grad)))
    return out


def worker(rank, port, out_dir):
    torch.set_num_threads(1)
    x, y = make_data()
    # References first, before any process group exists: plain single-process code paths.
    assert not nkd.is_distributed() and nkd.rank() == 0 and nkd.world_size() == 1
    results = {"train_single": train(x, y, lambda b: b),
               "trainer_single": run_trainer(x, y, os.path.join(out_dir, f"single{rank}")),
               "fresh_single": run_trainer(x, y, os.path.join(out_dir, f"fresh_single{rank}"),
                                           **FRESH)}
    join(rank, port)
    results["train_dist"] = train(x, y, lambda b: b[rank::WORLD])
    results["trainer_dist"] = run_trainer(x, y, os.path.join(out_dir, f"dist{rank}"))
    results["fresh_dist"] = run_trainer(x, y, os.path.join(out_dir, f"fresh_dist{rank}"), **FRESH)
    # Batches of different sizes per rank (5 rows on rank 0, 2 on rank 1), rows shared by
    # both ranks with different embeddings: every rank writes every row, the higher rank last.
    bank = CentreBank(torch.zeros(N, D), torch.zeros(N, dtype=torch.long))
    idx = torch.tensor([0, 1, 2, 3, 4]) if rank == 0 else torch.tensor([3, 9])
    from nnkloss.experiment.bank_upkeep import write_fresh_centres
    write_fresh_centres(bank, idx, torch.full((len(idx), D), float(rank + 1)), 0.0)
    results["uneven_write"] = bank.centres.clone()
    results["sync"] = sync_loss_parameters_cases(rank)
    # A loader over part of its dataset (a sampler of its own): refused, not widened to all.
    results["sampler_errors"] = []
    for sampler in (torch.utils.data.SubsetRandomSampler(range(6)),
                    torch.utils.data.RandomSampler(range(N), num_samples=6),
                    torch.utils.data.WeightedRandomSampler([1.0] * N, N)):
        try:
            nkd.shard_loader(DataLoader(list(range(N)), batch_size=2, sampler=sampler))
            results["sampler_errors"].append(None)
        except ValueError as exc:
            results["sampler_errors"].append(str(exc))
    finish(results, rank, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(worker, str(tmp_path_factory.mktemp("dist")))


def resume_worker(rank, port, out_dir):
    """fit(1) then fit(2) on one Trainer, rank 0 slow to write its checkpoints: the second
    fit() reads the checkpoint of the first on every rank."""
    from nnkloss.experiment import checkpoint as ckpt
    from nnkloss.experiment.train import Trainer
    torch.set_num_threads(1)
    x, y = make_data()
    join(rank, port)
    if rank == 0:  # a slow disk: the other rank reaches the end of fit() first
        save = ckpt.save

        def slow_save(path, state):
            time.sleep(2.0)
            return save(path, state)
        ckpt.save = slow_save
    ds = IndexedTensorDataset(x[:36], y[:36])
    model = make_model(dropout=False)
    bank = CentreBank(torch.zeros(36, D), torch.zeros(36, dtype=torch.long))
    crit = NeighbourKernelLoss(bank, sigma=0.8)
    refresher = Refresher(bank, model, nkd.shard_loader(DataLoader(ds, batch_size=10),
                                                        split_batch=False),
                          K, search_backend="torch", progress=False)
    trainer = Trainer(model, crit, nkd.shard_loader(DataLoader(ds, batch_size=GLOBAL_BATCH)),
                      lr=0.2, refresher=refresher,
                      schedule=nnkloss.RefreshSchedule(every_epochs=1),
                      out_dir=os.path.join(out_dir, "run"), progress=False, threads=None)
    trainer.fit(1)
    results = {"checkpoint_after_fit": os.path.isfile(trainer.checkpoint_path)}
    trainer.fit(2)
    results.update(epoch=trainer.epoch, step=trainer.step, centres=bank.centres.clone(),
                   weight=model[0].weight.detach().clone())
    finish(results, rank, out_dir)


class _Draws(nn.Module):
    """Identity that records one draw of torch's global RNG per training forward (what a
    Dropout's mask is drawn from)."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def forward(self, x):
        if self.training:
            self.draws.append(torch.rand(x.shape[0]))
        return x


def dropout_worker(rank, port, out_dir):
    """One epoch of the Trainer; the random draws each rank's forwards made."""
    from nnkloss.experiment.train import Trainer
    from nnkloss.experiment.models import SoftmaxHead
    torch.set_num_threads(1)
    x, y = make_data()
    join(rank, port)
    ds = IndexedTensorDataset(x[:36], y[:36])
    draws = _Draws()
    model = nn.Sequential(make_model(dropout=False), draws)
    trainer = Trainer(model, SoftmaxHead(D, CLASSES),
                      nkd.shard_loader(DataLoader(ds, batch_size=GLOBAL_BATCH)), lr=0.1,
                      progress=False, threads=None, seed=3)
    trainer.fit(1)
    finish({"draws": torch.cat(draws.draws)}, rank, out_dir)


def test_trainer_draws_other_random_numbers_on_every_rank(tmp_path):
    """Every rank reseeded from the same (seed, epoch): row j of every rank's batch got the
    same dropout mask, so the global batch held each mask world-size times."""
    results = run(dropout_worker, str(tmp_path))
    a, b = results[0]["draws"], results[1]["draws"]
    assert a.shape == b.shape == (18,)
    assert not torch.equal(a, b)


def test_fit_after_fit_resumes_every_rank_from_rank_0s_last_checkpoint(tmp_path):
    """Rank 0 alone writes checkpoints; a rank that left fit() before rank 0's write ended
    resumed the next fit() from the checkpoint before (ranks an epoch apart: a collective
    timeout) and removed rank 0's temporary file while rank 0 wrote it."""
    results = run(resume_worker, str(tmp_path))
    assert [r["checkpoint_after_fit"] for r in results] == [True, True]
    assert [(r["epoch"], r["step"]) for r in results] == [(2, 6), (2, 6)]
    _same(results[0], results[1])


# ---------------------------------------------------------------------------- tests
def test_ddp_steps_match_one_process_with_the_global_batch(results):
    single = results[0]["train_single"]
    for r in results:
        dist_run = r["train_dist"]
        assert dist_run["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
        for key, v in single["params"].items():
            torch.testing.assert_close(dist_run["params"][key], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{key}: {m}")
    # The per-rank valid counts differ, so the plain mean of per-rank means would NOT match.
    c0, c1 = results[0]["train_dist"]["counts"], results[1]["train_dist"]["counts"]
    assert c0 != c1
    assert [a + b for a, b in zip(c0, c1, strict=True)] == single["counts"]
    _same(results[0]["train_dist"]["params"], results[1]["train_dist"]["params"])


def test_trainer_under_ddp_matches_one_process(results):
    single = results[0]["trainer_single"]
    for r in results:
        multi = r["trainer_dist"]
        for a, b in zip(multi["history"], single["history"], strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        for key, v in single["params"].items():
            torch.testing.assert_close(multi["params"][key], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{key}: {m}")
    # Only rank 0 writes logs and checkpoints.
    assert {"checkpoint.pt", "log.csv", "log.json"} <= set(results[0]["trainer_dist"]["files"])
    assert results[1]["trainer_dist"]["files"] == []
    assert results[1]["trainer_single"]["files"] == results[0]["trainer_single"]["files"]


def test_fresh_centres_under_ddp_keep_banks_identical_and_match_one_process(results):
    single = results[0]["fresh_single"]
    plain = results[0]["trainer_single"]
    # The options did something: the bank differs from the run without them.
    assert not torch.equal(single["params"]["centres"], plain["params"]["centres"])
    for r in results:
        multi = r["fresh_dist"]
        for a, b in zip(multi["history"], single["history"], strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
        for key, v in single["params"].items():  # lists rebuilt from the written bank too
            torch.testing.assert_close(multi["params"][key], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{key}: {m}")
    _same(results[0]["fresh_dist"]["params"], results[1]["fresh_dist"]["params"])


def test_fresh_centres_gather_uneven_batches_in_rank_order(results):
    expected = torch.zeros(N, D)
    expected[[0, 1, 2, 4]] = 1.0
    expected[[3, 9]] = 2.0  # row 3 is in both ranks' batches: the higher rank wins
    for r in results:
        assert torch.equal(r["uneven_write"], expected)


def test_sync_loss_parameters_reads_nothing_when_every_gradient_is_present(results):
    # both present: mean of 2 and 3, no read; rank 0's only: (2 + 0) / 2, read where it is
    # None (rank 1); none: None, read on both
    for rank, r in enumerate(results):
        assert r["sync"] == [(0, 2.5), (rank, 1.0), (1, None)], r["sync"]


def test_shard_loader_refuses_a_loader_with_a_sampler_of_its_own(results):
    """A DistributedSampler over the whole dataset took the place of a loader's own sampler: a
    loader over rows 0..5 became one over all N rows, without a word."""
    for r in results:
        assert len(r["sampler_errors"]) == 3
        for err, name in zip(r["sampler_errors"], ("SubsetRandomSampler", "RandomSampler",
                                                   "WeightedRandomSampler")):
            assert err is not None and "whole dataset" in err and name in err


def test_single_process_helpers_are_no_ops(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert not nkd.is_distributed() and nkd.rank() == 0 and nkd.world_size() == 1
    assert nkd.is_main_process() and nkd.distributed_sampler([1, 2, 3], shuffle=True) is None
    model = nn.Linear(2, 2)
    assert nkd.wrap_model(model) is model
    loss = torch.tensor(2.5)
    assert nkd.global_mean(loss, 3) is loss
    assert nkd.sum_over_ranks(4) == 4 and nkd.mean_over_ranks(loss) is loss
    loader = DataLoader(list(range(6)), batch_size=4)
    assert nkd.shard_loader(loader) is loader
    model(torch.ones(1, 2)).sum().backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    nkd.sync_loss_parameters(model)
    nkd.broadcast_buffers(model)
    for n, p in model.named_parameters():  # nothing averaged or overwritten
        assert torch.equal(p.detach(), before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert nkd.per_rank_batch_size(12) == 12
    assert nkd.init_from_env() is False  # no torchrun environment: stays single-process
    assert not nkd.is_distributed()


def test_init_from_env_refuses_a_partial_environment(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert nkd.init_from_env() is False
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        nkd.init_from_env()


def test_init_from_env_hands_its_dist_backend_to_torch(monkeypatch):
    """The process group's backend is ``dist_backend`` (issue 19: ``backend`` is the op's)."""
    for v, val in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29999")):
        monkeypatch.setenv(v, val)
    seen = []
    monkeypatch.setattr(nkd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(nkd.dist, "init_process_group",
                        lambda backend, **kw: seen.append(backend))
    assert nkd.init_from_env(dist_backend="gloo") is False  # world size 1: not distributed
    assert seen == ["gloo"]
    with pytest.raises(TypeError):
        nkd.init_from_env(backend="gloo")


def test_shard_loader_keeps_every_loader_setting(monkeypatch):
    """The sharded loader keeps the loader's settings, its workers' prefetch_factor included
    (None without workers), and divides the batch by the world size."""
    monkeypatch.setattr(nkd, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(nkd, "world_size", lambda group=None: 2)
    monkeypatch.setattr(nkd, "rank", lambda group=None: 1)
    for workers, prefetch in ((0, None), (2, 3)):
        kw = {"prefetch_factor": prefetch} if workers else {}
        out = nkd.shard_loader(DataLoader(list(range(8)), batch_size=4, num_workers=workers,
                                          drop_last=True, **kw))
        assert (out.num_workers, out.prefetch_factor, out.batch_size, out.drop_last) == (
            workers, prefetch, 2, True)
