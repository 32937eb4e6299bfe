"""torch.distributed: refresh split over two gloo processes, and DDP training steps.

One spawn of two CPU processes (gloo on 127.0.0.1) runs every scenario; each child computes the
single-process references BEFORE joining the process group (so they run the same numerics on
the same thread count), then the distributed versions, and writes tensors to tmp_path. The
tests below compare the files. A deadline kills the children, so a hang fails fast instead of
stalling CI.
"""
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

from nnkloss.experiment.datasets import IndexedTensorDataset
import nnkloss
from nnkloss import CentreBank, NeighbourKernelLoss, Refresher
from nnkloss import distributed as nkd
from nnkloss.bank.search import faiss_available

WORLD = 2
N = 37  # odd: DistributedSampler pads rank 1 with a repeat of row 0
D_IN, D, CLASSES, K = 6, 4, 12, 3  # many classes, short lists: ensure_positive has work to do
DEADLINE_S = 120.0
STEPS, GLOBAL_BATCH = 3, 12


def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D_IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g)


def make_model(dropout=True):
    torch.manual_seed(0)
    layers = [nn.Linear(D_IN, 16), nn.ReLU()]
    if dropout:  # the Refresher embeds in eval mode: dropout must not reach the bank
        layers.append(nn.Dropout(0.5))
    return nn.Sequential(*layers, nn.Linear(16, D))


def empty_bank(dtype=torch.float32):
    return CentreBank(torch.zeros(N, D, dtype=dtype), torch.zeros(N, dtype=torch.long))


def refresh(loader, dtype=torch.float32, backend="torch", ensure_positive=True):
    bank = empty_bank(dtype)
    stats = Refresher(bank, make_model(), loader, K, backend=backend,
                      ensure_positive=ensure_positive, progress=False).refresh()
    return {"centres": bank.centres.clone(), "labels": bank.labels.clone(),
            "neighbours": bank.neighbours.clone(), "num_patched": stats.num_patched,
            "positive_share": stats.positive_share,
            "mean_sq_distance": stats.mean_sq_distance}


def refresh_cases(ds, single: bool):
    """(name, kwargs, loader) of every refresh scenario; one loader over all rows if single."""
    cases = []
    for name, shuffle, batch, dtype, backend in [
            ("fp32", False, 5, torch.float32, "torch"),
            ("shuffled", True, 4, torch.float32, "torch"),
            ("bf16", False, 5, torch.bfloat16, "torch"),
            ("faiss", False, 5, torch.float32, "faiss")]:
        if backend == "faiss" and not faiss_available():
            continue
        if single:
            loader = DataLoader(ds, batch_size=8)
        else:
            sampler = nkd.distributed_sampler(ds, shuffle=shuffle, seed=5)
            loader = DataLoader(ds, batch_size=batch, sampler=sampler)
        cases.append((name, dict(dtype=dtype, backend=backend), loader))
    return cases


# ---------------------------------------------------------------------------- training
def fixed_bank():
    """A bank whose lists leave some rows without a positive: per-rank valid counts differ."""
    g = torch.Generator().manual_seed(2)
    bank = CentreBank(torch.randn(N, D, generator=g), torch.randint(0, CLASSES, (N,), generator=g),
                      weights=torch.rand(N, generator=g) + 0.5)
    bank.rebuild_neighbours(K, backend="torch")
    return bank


def global_batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randperm(N, generator=g)[:GLOBAL_BATCH] for _ in range(STEPS)]


def train(x, y, rows_of_step):
    """STEPS SGD steps; ``rows_of_step(batch)`` picks this process's rows of a global batch.
    Returns the per-step loss as seen by the whole job, counts, and the final parameters."""
    model = make_model(dropout=False)
    crit = NeighbourKernelLoss(fixed_bank(), sigma=0.8, learn_sigma=True, learn_weights=True)
    net = nkd.wrap_model(model)
    opt = torch.optim.SGD(list(model.parameters()) + list(crit.parameters()), lr=0.3,
                          momentum=0.9)
    losses, counts = [], []
    for batch in global_batches():
        idx = rows_of_step(batch)
        loss = crit(net(x[idx]), y[idx], idx)
        counts.append(int(crit.last_num_valid))
        loss = nkd.global_mean(loss, crit.last_num_valid)
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


def run_trainer(x, y, out_dir):
    """Two epochs of the Trainer (refresh before the first and after each epoch); the loaders
    are sharded under torch.distributed. 36 rows, global batch 12: unshuffled shards of 6 rows
    per rank make the same global batches as one process, with no sampler padding."""
    from nnkloss.experiment.train import Trainer
    ds = IndexedTensorDataset(x[:36], y[:36])
    model = make_model(dropout=False)
    bank = CentreBank(torch.zeros(36, D), torch.zeros(36, dtype=torch.long))
    crit = NeighbourKernelLoss(bank, sigma=0.8, learn_sigma=True, learn_weights=True)
    ordered = nkd.shard_loader(DataLoader(ds, batch_size=10), split_batch=False)
    refresher = Refresher(bank, model, ordered, K, backend="torch", progress=False)
    train_loader = nkd.shard_loader(DataLoader(ds, batch_size=GLOBAL_BATCH))
    trainer = Trainer(model, crit, train_loader, optimizer="sgd", lr=0.2, weight_decay=1e-3,
                      refresher=refresher, schedule=nnkloss.RefreshSchedule(every_epochs=1),
                      out_dir=out_dir, progress=False, seed=3)
    history = trainer.fit(2, resume=False)
    params = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    params["log_sigma"] = crit.log_sigma.detach().clone()
    params["log_weights"] = bank.log_weights.detach().clone()
    params["centres"] = bank.centres.clone()
    params["neighbours"] = bank.neighbours.clone()
    return {"history": [{k: r[k] for k in ("loss", "valid_frac", "sigma")} for r in history],
            "params": params, "files": sorted(os.listdir(out_dir))}


# ---------------------------------------------------------------------------- the children
def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    x, y = make_data()
    ds = IndexedTensorDataset(x, y)
    results = {"refresh_single": {}, "refresh_dist": {}}
    # References first, before any process group exists: plain single-process code paths.
    assert not nkd.is_distributed() and nkd.rank() == 0 and nkd.world_size() == 1
    for name, kw, loader in refresh_cases(ds, single=True):
        results["refresh_single"][name] = refresh(loader, **kw)
    results["train_single"] = train(x, y, lambda b: b)
    results["trainer_single"] = run_trainer(x, y, os.path.join(out_dir, f"single{rank}"))

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert nkd.init_from_env(timeout_s=60)
    assert nkd.is_distributed() and nkd.rank() == rank and nkd.world_size() == WORLD
    assert nkd.is_main_process() == (rank == 0)
    for name, kw, loader in refresh_cases(ds, single=False):
        results["refresh_dist"][name] = refresh(loader, **kw)

    # Rows written by both ranks with different values: the lowest rank's win everywhere;
    # tiny rounds (3 rows per all_gather) exercise the chunked exchange.
    rows = torch.arange(N)
    written = (rows % WORLD == rank) | (rows < 3)
    centres = torch.full((N, D), float(rank + 1)).masked_fill(~written[:, None], float("nan"))
    labels = y.clone().masked_fill(~written, -5)
    nkd.gather_bank_rows(centres, labels, written, chunk_bytes=3 * D * 4)
    results["gathered"] = {"centres": centres, "labels": labels}
    lists = nkd.neighbour_lists(x, y, K, search_backend="torch", chunk_bytes=5 * K * 8)
    results["lists_small_rounds"] = lists.indices

    # Rows that no rank embeds: a clear error on every rank, the bank untouched.
    sub = torch.utils.data.Subset(ds, list(range(N - 3)))
    loader = DataLoader(sub, batch_size=5, sampler=nkd.distributed_sampler(sub, shuffle=False))
    bank = empty_bank()
    bank.centres.fill_(7.0)
    try:
        Refresher(bank, make_model(), loader, K, backend="torch", progress=False).refresh()
        results["missing_error"] = None
    except ValueError as exc:
        results["missing_error"] = str(exc)
    results["missing_untouched"] = bool((bank.centres == 7.0).all())
    try:
        Refresher(empty_bank(), make_model(), loader, K, progress=False).refresh_async()
        results["async_error"] = None
    except RuntimeError as exc:
        results["async_error"] = str(exc)

    results["train_dist"] = train(x, y, lambda b: b[rank::WORLD])
    results["trainer_dist"] = run_trainer(x, y, os.path.join(out_dir, f"dist{rank}"))
    nkd.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    nkd.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist"))
    ctx = mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):  # re-raises a child's exception with its traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed workers did not finish within {DEADLINE_S} s")
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ---------------------------------------------------------------------------- tests
def test_refreshed_bank_identical_on_every_rank(results):
    r0, r1 = results[0]["refresh_dist"], results[1]["refresh_dist"]
    assert r0.keys() == r1.keys() and "fp32" in r0
    for name in r0:
        _same(r0[name], r1[name])


def test_distributed_refresh_equals_single_process(results):
    single, multi = results[0]["refresh_single"], results[0]["refresh_dist"]
    assert single.keys() == multi.keys()
    for name in single:
        s, m = single[name], multi[name]
        # Rows embedded in other batch compositions may differ in the last bits.
        tol = dict(rtol=1e-2, atol=1e-2) if s["centres"].dtype == torch.bfloat16 else {}
        torch.testing.assert_close(m["centres"], s["centres"], **tol)
        assert m["centres"].dtype == s["centres"].dtype
        assert torch.equal(m["labels"], s["labels"]), name
        assert torch.equal(m["neighbours"], s["neighbours"]), name
        assert m["num_patched"] == s["num_patched"] > 0, name
        assert m["positive_share"] == s["positive_share"], name
    assert torch.equal(single["fp32"]["labels"], make_data()[1])


def test_rows_written_twice_take_the_lowest_rank(results):
    owner = torch.where(torch.arange(N) < 3, 0, torch.arange(N) % WORLD)
    expected = (owner + 1).float()[:, None].expand(N, D)
    x, y = make_data()
    for r in results:
        assert torch.equal(r["gathered"]["centres"], expected)
        assert torch.equal(r["gathered"]["labels"], y)
        single = nnkloss.bank.search.neighbour_lists(x, y, K, search_backend="torch").indices
        assert torch.equal(r["lists_small_rounds"], single)


def test_rows_nobody_embedded_raise_on_every_rank(results):
    for r in results:
        assert r["missing_error"] is not None and "no rank's loader yielded 3" in r["missing_error"]
        assert "[34, 35, 36]" in r["missing_error"]
        assert r["missing_untouched"]


def test_async_refresh_refused(results):
    for r in results:
        assert r["async_error"] is not None and "async_mode=False" in r["async_error"]


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
    nkd.check_async_refresh()
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
