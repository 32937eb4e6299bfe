"""Centre refresh: rebuild_neighbours, Refresher (sync and async), RefreshSchedule."""
import contextlib
import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnkloss.experiment.datasets import IndexedTensorDataset
import nnkloss
from nnkloss import CentreBank, Refresher, RefreshSchedule, RefreshStats
from nnkloss.bank.search import faiss_available, neighbour_lists

from cases import spy_batch_norms

N, D_IN, D = 96, 6, 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, D))


def make_data(seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return x, y


def make_loader(x, y, shuffle=True, batch_size=16):
    return DataLoader(IndexedTensorDataset(x, y), batch_size=batch_size, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(3))


def make_bank(n=N, d=D):
    # Placeholder centres and labels: the refresh must overwrite every row.
    return CentreBank(torch.zeros(n, d), torch.zeros(n, dtype=torch.long))


def eval_embeddings(model, x):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train(was)
    return out


def bank_state(bank):
    return (bank.centres.clone(), bank.centre_labels.clone(), bank.neighbours.clone())


def assert_bank_equal(bank, state):
    c, l, nb = state
    assert torch.equal(bank.centres, c) and torch.equal(bank.centre_labels, l)
    assert torch.equal(bank.neighbours, nb)


# ============================================================================ Refresher (sync)
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
def test_refresh_writes_eval_embeddings_at_idx(bank_dtype):
    x, y = make_data()
    model = make_model()
    model.train()
    bank = CentreBank(torch.zeros(N, D, dtype=bank_dtype), torch.zeros(N, dtype=torch.long))
    ref = Refresher(bank, model, make_loader(x, y), k=8, search_backend="torch", progress=False)
    stats = ref.refresh(sigma=2.0)
    assert model.training and all(m.training for m in model.modules())
    expected = eval_embeddings(model, x).to(bank_dtype)
    assert torch.equal(bank.centres, expected)  # dropout off, each row at its own idx
    assert torch.equal(bank.centre_labels, y)
    lists = neighbour_lists(bank.centres, bank.centre_labels, 8, search_backend="torch")
    assert torch.equal(bank.neighbours, lists.neighbours)
    assert isinstance(stats, RefreshStats) and ref.last_stats is stats
    assert stats.num_rows == N and stats.k == 8 and stats.overlap is None
    assert stats.embed_seconds >= 0 and stats.search_seconds >= 0
    assert stats.mean_sq_distance == pytest.approx(float(lists.distances.mean()), rel=1e-5)
    kern = torch.exp(-lists.distances / (2 * 2.0 ** 2)).mean()
    assert stats.mean_kernel == pytest.approx(float(kern), rel=1e-5) and stats.sigma == 2.0
    assert stats.positive_share == pytest.approx(float(lists.has_positive.float().mean()))
    assert stats.search_backend == "torch" and not stats.asynchronous
    # Same model again: identical lists, full overlap.
    again = ref.refresh()
    assert again.overlap == pytest.approx(1.0) and again.mean_kernel is None


def test_refresh_folds_batch_norm_and_leaves_the_model_alone(monkeypatch):
    """The centres are the model's eval-mode embeddings computed with its BatchNorms folded
    (nnkloss/inference.py): equal up to rounding, and, without the recalibration, the model,
    its statistics and its mode unchanged."""
    x, y = make_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, D))
    model.train()
    for _ in range(3):  # running statistics that are not the identity's
        model(x * 3 + 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = Refresher(make_bank(), model, make_loader(x, y), k=4, search_backend="torch",
                    progress=False, recalibrate_bn=False)
    seen = spy_batch_norms(monkeypatch)
    ref.refresh()
    assert seen == []  # the folded copy ran: no BatchNorm did
    monkeypatch.undo()
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(ref.bank.centres, eval_embeddings(model, x), rtol=1e-5,
                               atol=1e-6)


def test_refresh_restores_mixed_modes_and_eval_mode():
    x, y = make_data()
    model = make_model()
    model.train()
    model[2].eval()  # e.g. a frozen submodule
    ref = Refresher(make_bank(), model, make_loader(x, y), k=4, search_backend="torch", progress=False)
    ref.refresh()
    assert model.training and model[0].training and not model[2].training
    model.eval()
    ref.refresh()
    assert not any(m.training for m in model.modules())


def test_refresh_overlap_and_positive_stats():
    x, y = make_data()
    model = make_model()
    bank = make_bank()
    ref = Refresher(bank, model, make_loader(x, y), k=6, search_backend="torch", progress=False,
                    ensure_positive=True, sigma=1.5)
    ref.refresh()
    old = bank.neighbours.clone()
    with torch.no_grad():
        model[0].weight.add_(0.3 * torch.randn_like(model[0].weight))
    stats = ref.refresh()
    assert stats.positive_share == 1.0 and stats.sigma == 1.5
    new = bank.neighbours
    shared = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 6 for a, b in zip(new, old, strict=True)])
    assert stats.overlap == pytest.approx(float(shared.mean()), abs=1e-6)
    assert 0.0 < stats.overlap < 1.0


class Boom(RuntimeError):
    pass


def failing_loader(x, y, fail_after):
    for b, (xb, yb, ib) in enumerate(make_loader(x, y)):
        if b == fail_after:
            raise Boom("disk on fire")
        yield xb, yb, ib


def test_failed_refresh_leaves_bank_and_mode_intact():
    x, y = make_data()
    model = make_model()
    model.train()
    bank = make_bank()
    Refresher(bank, model, make_loader(x, y), k=5, search_backend="torch", progress=False).refresh()
    state = bank_state(bank)
    ref = Refresher(bank, make_model(seed=9), failing_loader(x, y, fail_after=3), k=5,
                    search_backend="torch", progress=False)
    ref.model.train()
    with pytest.raises(Boom):
        ref.refresh()
    assert_bank_equal(bank, state)
    assert ref.model.training


def test_missing_rows_named():
    x, y = make_data()
    bank = make_bank()
    state = bank_state(bank)
    sub = [(xb, yb, ib) for xb, yb, ib in make_loader(x, y, shuffle=False)]
    keep_idx = sub[0][2][:6]
    sub[0] = (sub[0][0][:6], sub[0][1][:6], keep_idx)  # drop 10 rows of the first batch
    ref = Refresher(bank, make_model(), sub, k=5, search_backend="torch", progress=False)
    with pytest.raises(ValueError, match=r"never yielded 10 of the bank's 96 rows"):
        ref.refresh()
    assert_bank_equal(bank, state)


def test_bad_loader_and_model_outputs():
    x, y = make_data()
    bank = make_bank()
    state = bank_state(bank)
    bad_idx = [(x[:4], y[:4], torch.tensor([0, 1, 2, N]))]
    with pytest.raises(IndexError, match="outside the bank's rows"):
        Refresher(bank, make_model(), bad_idx, k=3, search_backend="torch", progress=False).refresh()
    with pytest.raises(ValueError, match=r"model output has shape \(16, 4\); expected"):
        Refresher(CentreBank(torch.zeros(N, 3), torch.zeros(N, dtype=torch.long)), make_model(),
                  make_loader(x, y), k=3, search_backend="torch", progress=False).refresh()

    class NaNModel(nn.Module):
        def forward(self, inp):
            return torch.full((inp.shape[0], D), float("nan"))

    with pytest.raises(ValueError, match="NaN/inf embeddings for 96 rows"):
        Refresher(bank, NaNModel(), make_loader(x, y), k=3, search_backend="torch",
                  progress=False).refresh()
    with pytest.raises(ValueError, match="triples"):
        Refresher(bank, make_model(), [(x, y)], k=3, progress=False).refresh()
    assert_bank_equal(bank, state)
    with pytest.raises(ValueError, match="k=96"):
        Refresher(bank, make_model(), make_loader(x, y), k=96)
    with pytest.raises(ValueError, match="sigma"):
        Refresher(bank, make_model(), make_loader(x, y), k=3, sigma=-1.0)


def test_refresh_with_progress_bar_and_approximate(capsys):
    if not faiss_available():
        pytest.skip("faiss missing")
    x, y = make_data()
    bank = make_bank()
    ref = Refresher(bank, make_model(), make_loader(x, y), k=5, progress=True,
                    knn_options={"approximate": "hnsw"})
    stats = ref.refresh()
    assert stats.search_backend == "faiss-hnsw" and bank.neighbours.shape == (N, 5)


# ============================================================================ Refresher (async)
def test_async_matches_sync_and_uses_a_snapshot():
    x, y = make_data()
    model = make_model()
    model.train()
    sync_bank, async_bank = make_bank(), make_bank()
    Refresher(sync_bank, model, make_loader(x, y), k=6, search_backend="torch",
              progress=False).refresh()
    ref = Refresher(async_bank, model, make_loader(x, y), k=6, search_backend="torch", progress=False,
                    async_mode=True)
    assert ref.request() is None and ref.in_flight
    # Training goes on: the live model changes while the background refresh runs.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    stats = ref.wait()
    assert isinstance(stats, RefreshStats) and stats.asynchronous and not ref.in_flight
    assert torch.equal(async_bank.centres, sync_bank.centres)
    assert torch.equal(async_bank.centre_labels, sync_bank.centre_labels)
    assert torch.equal(async_bank.neighbours, sync_bank.neighbours)
    assert model.training  # the live model's mode is never touched in async mode
    assert ref.poll() is None and ref.wait() is None  # nothing in flight any more


def test_async_snapshot_follows_a_model_moved_or_cast_after_construction():
    """The snapshot was made once, at construction: a model moved afterwards (Trainer(device=
    "cuda") moves one built on the CPU) was embedded by a snapshot left on the old device and
    every background refresh failed. Here the same with a cast (no GPU needed): the snapshot is
    remade where the model now is, and the refresh equals a synchronous one."""
    x, y = make_data()
    model = make_model()
    sync_bank, async_bank = make_bank(), make_bank()
    ref = Refresher(async_bank, model, make_loader(x.double(), y), k=6, search_backend="torch",
                    progress=False, async_mode=True)
    model.double()
    Refresher(sync_bank, model, make_loader(x.double(), y), k=6, search_backend="torch",
              progress=False).refresh()
    ref.refresh_async()
    assert ref.wait() is not None
    assert torch.equal(async_bank.centres, sync_bank.centres)
    assert torch.equal(async_bank.neighbours, sync_bank.neighbours)
    snap = ref._snapshot
    ref.refresh_async()  # unchanged placement: the same snapshot is reused
    ref.wait()
    assert ref._snapshot is snap


def test_async_poll_before_and_after_completion():
    x, y = make_data()
    gate = threading.Event()

    def gated_loader():
        gate.wait(timeout=30)
        yield from make_loader(x, y)

    bank = make_bank()
    ref = Refresher(bank, make_model(), gated_loader(), k=4, search_backend="torch", progress=False)
    ref.refresh_async(sigma=1.0)
    assert ref.poll() is None and ref.wait(timeout=0.01) is None
    with pytest.raises(RuntimeError, match="in flight"):
        ref.refresh()
    with pytest.raises(RuntimeError, match="in flight"):
        ref.refresh_async()
    assert torch.equal(bank.centres, torch.zeros(N, D))  # nothing swapped in yet
    gate.set()
    ref._thread.join(timeout=30)
    stats = ref.poll()
    assert stats is not None and stats.mean_kernel is not None
    assert not torch.equal(bank.centres, torch.zeros(N, D))


def test_async_failure_leaves_bank_intact():
    x, y = make_data()
    bank = make_bank()
    state = bank_state(bank)
    ref = Refresher(bank, make_model(), failing_loader(x, y, fail_after=2), k=4,
                    search_backend="torch", progress=False)
    ref.refresh_async()
    with pytest.raises(RuntimeError, match="background refresh failed") as info:
        ref.wait()
    assert isinstance(info.value.__cause__, Boom)
    assert_bank_equal(bank, state) and not ref.in_flight


def test_module_exports():
    for name in ("knn", "Refresher", "RefreshSchedule", "RefreshStats", "save_bank", "load_bank"):
        assert name in nnkloss.__all__ and hasattr(nnkloss, name)
    assert nnkloss.knn is nnkloss.bank.search.knn
    assert nnkloss.Refresher is Refresher and nnkloss.RefreshSchedule is RefreshSchedule
    # The exported knn is the exact search: same neighbours as a full distance matrix.
    a = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    dist, idx = nnkloss.knn(a, a, 2, search_backend="torch")
    full = torch.cdist(a.double(), a.double()) ** 2
    want = full.topk(2, dim=1, largest=False)
    assert torch.equal(idx, want.indices)
    torch.testing.assert_close(dist.double(), want.values, rtol=1e-5, atol=1e-5)


# ============================================================================ schedule
def test_schedule_epochs_and_steps():
    s = RefreshSchedule(every_epochs=3)
    assert [s.epoch_end() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert not any(s.step() for _ in range(50))  # no step interval: steps never fire
    s = RefreshSchedule(every_steps=4)
    assert [s.step() for _ in range(9)] == [False] * 3 + [True] + [False] * 3 + [True, False]
    s = RefreshSchedule(every_epochs=2, every_steps=5)
    assert s.should_refresh(epoch=2) and s.should_refresh(step=10)
    assert not s.should_refresh(epoch=3, step=7) and s.should_refresh(epoch=3, step=15)
    assert not s.should_refresh(epoch=0, step=0) and not s.should_refresh()


def test_schedule_state_and_errors():
    s = RefreshSchedule(every_epochs=2, every_steps=3)
    for _ in range(5):
        s.step()
    s.epoch_end()
    t = RefreshSchedule(every_epochs=2, every_steps=3)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.global_step) == (1, 5)
    assert t.step() and t.epoch_end()  # step 6 and epoch 2
    with pytest.raises(ValueError, match="every_epochs"):
        RefreshSchedule(every_epochs=0)
    with pytest.raises(ValueError, match="every_steps"):
        RefreshSchedule(every_steps=2.5)
    with pytest.raises(ValueError, match="every_epochs and/or every_steps"):
        RefreshSchedule()


def test_schedule_drives_a_training_loop():
    x, y = make_data()
    model = make_model()
    bank = make_bank()
    ref = Refresher(bank, model, make_loader(x, y, shuffle=False), k=4, search_backend="torch",
                    progress=False)
    ref.refresh()
    sched = RefreshSchedule(every_epochs=2)
    refreshed = []
    for epoch in range(4):
        if sched.epoch_end():
            refreshed.append(epoch)
            ref.refresh()
    assert refreshed == [1, 3]


# ============================================================================ current sigma
def test_stats_read_the_loss_current_sigma_not_a_frozen_copy():
    """kernel_criterion hands the loss to its Refresher: a learned sigma that moved is the one
    the statistics use (a float copy taken at construction reported the initial sigma)."""
    from nnkloss.experiment.setup import kernel_criterion
    x, y = make_data()
    model = make_model()
    loss, ref = kernel_criterion(model, make_loader(x, y, shuffle=False), y, D, sigma=2.0, k=6,
                                 device="cpu", learn_sigma=True, search_backend="torch")
    assert ref.refresh().sigma == pytest.approx(2.0)
    with torch.no_grad():
        loss.log_sigma.fill_(0.0)  # sigma 1, as training might have moved it
    stats = ref.refresh()
    assert stats.sigma == pytest.approx(1.0) and ref.sigma == pytest.approx(1.0)
    # mean_kernel follows the same sigma
    assert stats.mean_kernel == pytest.approx(
        float(torch.exp(-bank_sq_dist(loss.bank) / 2.0).mean()), rel=1e-5)
    assert ref.refresh(sigma=3.0).sigma == 3.0  # a call's sigma still wins


def bank_sq_dist(bank):
    c = bank.centres.double()
    nb = bank.neighbours.long()
    return (c[:, None, :] - c[nb]).pow(2).sum(-1)


@pytest.mark.parametrize("source", ["loss", "callable", "tensor"])
def test_refresher_sigma_sources_are_read_at_each_refresh(source):
    x, y = make_data()
    bank = make_bank()
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=0.5, learn_sigma=True)
    box = {"sigma": 0.5}
    t = torch.tensor(0.5)
    sigma = {"loss": loss, "callable": lambda: box["sigma"], "tensor": t}[source]
    ref = Refresher(bank, make_model(), make_loader(x, y), k=4, search_backend="torch", sigma=sigma)
    assert ref.refresh().sigma == pytest.approx(0.5)
    with torch.no_grad():
        loss.log_sigma.fill_(float(torch.tensor(4.0).log()))
    box["sigma"] = 4.0
    t.fill_(4.0)
    assert ref.refresh().sigma == pytest.approx(4.0)
    box["sigma"] = -1.0
    t.fill_(-1.0)
    if source != "loss":  # a source that went bad is refused when read
        with pytest.raises(ValueError, match="sigma"):
            ref.refresh()


def test_refresher_bad_sigma_sources():
    x, y = make_data()
    with pytest.raises(ValueError, match="sigma"):
        Refresher(make_bank(), make_model(), make_loader(x, y), k=4, sigma=torch.ones(2))
    with pytest.raises(ValueError, match="sigma"):
        Refresher(make_bank(), make_model(), make_loader(x, y), k=4, sigma=torch.tensor(0.0))
    with pytest.raises(TypeError, match="sigma"):
        Refresher(make_bank(), make_model(), make_loader(x, y), k=4, sigma="1.0")


# ============================================================================ quiet by default
def test_refresher_is_quiet_by_default(capsys):
    x, y = make_data()
    ref = Refresher(make_bank(), make_model(), make_loader(x, y), k=4, search_backend="torch")
    assert ref.progress is False
    ref.refresh()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    ref.progress = True  # asked for: a bar on stderr
    ref.refresh()
    assert "refresh: embedding" in capsys.readouterr().err


# ============================================================================ lists from the bank
class NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D)

    def forward(self, x):
        raise AssertionError("rebuild_neighbours must not embed anything")


def test_rebuild_lists_uses_current_centres_without_embedding():
    x, y = make_data()
    g = torch.Generator().manual_seed(5)
    bank = CentreBank(torch.randn(N, D, generator=g), y.clone())
    ref = Refresher(bank, NoForward(), make_loader(x, y), k=3, search_backend="torch",
                    ensure_positive=True, sigma=0.7)
    first = ref.rebuild_neighbours()
    expected = neighbour_lists(bank.centres, bank.centre_labels, 3, search_backend="torch",
                               ensure_positive=True)
    assert torch.equal(bank.neighbours, expected.neighbours.to(bank.neighbours.dtype))
    assert first.overlap is None and first.embed_seconds == 0.0 and first.num_patched > 0
    assert first.positive_share == 1.0 and first.sigma == 0.7 and first.k == 3
    old = bank.neighbours.clone()
    bank.write_centres_(torch.arange(0, N, 2), torch.randn(N // 2, D, generator=g))
    second = ref.rebuild_neighbours(sigma=2.0)
    expected = neighbour_lists(bank.centres, bank.centre_labels, 3, search_backend="torch",
                               ensure_positive=True)
    assert torch.equal(bank.neighbours, expected.neighbours.to(bank.neighbours.dtype))
    shared = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 3
                           for a, b in zip(bank.neighbours, old, strict=True)])
    assert second.overlap == pytest.approx(float(shared.mean()), abs=1e-6)
    assert 0.0 < second.overlap < 1.0 and second.sigma == 2.0
    assert torch.equal(bank.centre_labels, y.to(bank.centre_labels.dtype))  # centres and labels untouched


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
@pytest.mark.parametrize("name", ["every_epochs", "every_steps"])
def test_schedule_errors_name_the_interval(name):
    """kills refresh RefreshSchedule.__init__ 1, 3."""
    with pytest.raises(ValueError, match=rf"^{name} must be a positive int, got 0$"):
        nnkloss.RefreshSchedule(**{name: 0})


def test_schedule_state_dict_records_intervals_and_counters():
    """The state saved in checkpoints names both intervals and both counters (kills refresh
    RefreshSchedule.state_dict 1-4)."""
    sched = nnkloss.RefreshSchedule(every_epochs=5, every_steps=3)
    sched.step()
    sched.epoch_end()
    assert sched.state_dict() == {"every_epochs": 5, "every_steps": 3, "epoch": 1,
                                  "global_step": 1}


def test_schedule_fires_at_the_first_count_and_on_either_interval():
    """Interval 1 fires after the first epoch / step; either interval firing is enough, in
    both orders (kills refresh RefreshSchedule.should_refresh 10, 17, 21)."""
    every = nnkloss.RefreshSchedule(every_epochs=1, every_steps=1)
    assert every.should_refresh(epoch=1) and every.should_refresh(step=1)
    assert not every.should_refresh(epoch=0) and not every.should_refresh(step=0)
    both = nnkloss.RefreshSchedule(every_epochs=5, every_steps=3)
    assert both.should_refresh(epoch=5, step=1)
    assert both.should_refresh(epoch=1, step=3)
    assert not both.should_refresh(epoch=4, step=4)
    assert nnkloss.RefreshSchedule(every_steps=1).step()
    assert nnkloss.RefreshSchedule(every_epochs=1).epoch_end()


def test_schedule_that_never_fires_is_refused_with_the_reason():
    """kills refresh RefreshSchedule.__init__ 14, 16, 17 (the message)."""
    with pytest.raises(ValueError, match=r"^give every_epochs and/or every_steps \(a schedule "
                                         r"that never fires would leave the centres stale "
                                         r"forever\)$"):
        nnkloss.RefreshSchedule()


def _refresh_setup(n=24, d_in=5, d=3, gate=None):
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(n, d_in, generator=g), torch.arange(n) % 3
    batches = [(x[i:i + 8], y[i:i + 8], torch.arange(i, min(n, i + 8))) for i in range(0, n, 8)]

    class Loader:
        def __iter__(self):
            if gate is not None:
                assert gate.wait(10)
            return iter(batches)

    torch.manual_seed(0)
    bank = nnkloss.CentreBank(torch.zeros(n, d), torch.zeros(n, dtype=torch.long))
    return bank, torch.nn.Linear(d_in, d), Loader()


@pytest.mark.parametrize("async_mode", [False, True])
def test_request_passes_its_sigma_on(async_mode):
    """request(sigma) is the sigma of that refresh's statistics, sync or async (kills refresh
    Refresher.request 1, 2)."""
    bank, model, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                            async_mode=async_mode)
    stats = ref.request(sigma=2.0)
    if async_mode:
        assert stats is None
        stats = ref.wait()
    assert stats.sigma == 2.0 and stats.mean_kernel is not None and stats.asynchronous == async_mode


def test_poll_and_wait_of_a_background_refresh():
    """poll() is None with nothing started and swaps in a finished refresh; wait(timeout) returns
    None while the refresh is still running; a second start is refused with the reason; the
    work runs in a daemon thread (kills refresh Refresher.poll 2, wait 2, refresh_async 2, 21,
    22, 24, 25)."""
    import threading
    import time

    gate = threading.Event()
    bank, model, loader = _refresh_setup(gate=gate)
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False)
    assert ref.poll() is None and ref.wait() is None
    before = set(threading.enumerate())
    ref.refresh_async()
    # A daemon thread: a refresh still running never keeps the interpreter from exiting.
    started = set(threading.enumerate()) - before
    assert started and all(t.daemon for t in started)
    with pytest.raises(RuntimeError, match=r"^a background refresh is already in flight: "
                                           r"poll\(\)/wait\(\) first$"):
        ref.refresh_async()
    t0 = time.perf_counter()
    assert ref.wait(timeout=0.05) is None and ref.in_flight
    assert time.perf_counter() - t0 < 5
    assert ref.poll() is None
    gate.set()
    stats = None
    for _ in range(1000):
        stats = ref.poll()
        if stats is not None:
            break
        time.sleep(0.01)
    assert stats is not None and stats.asynchronous and not ref.in_flight
    assert bank.has_neighbours and bank.k == 4


def test_refresh_stats_with_one_neighbour():
    """k = 1: a second refresh with the same model finds the same lists (overlap 1.0), and the
    mean squared distance of a two-row bank is that one distance (kills refresh _list_overlap
    30, _make_stats 44, 58)."""
    bank, model, loader = _refresh_setup(n=2)
    ref = nnkloss.Refresher(bank, model, loader, k=1, search_backend="torch", progress=False)
    first = ref.refresh()
    assert first.overlap is None and first.asynchronous is False
    again = ref.refresh()
    assert again.overlap == 1.0 and again.num_patched == 0
    d = float(((bank.centres[0] - bank.centres[1]) ** 2).sum())
    assert again.mean_sq_distance == pytest.approx(d, rel=1e-5)


def test_refresh_errors_say_what_to_do():
    """A sync refresh while one is in flight, and a failed background refresh (kills refresh
    Refresher.refresh 2, _finish 6)."""
    import threading

    gate = threading.Event()
    bank, model, loader = _refresh_setup(gate=gate)
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False)
    ref.refresh_async()
    with pytest.raises(RuntimeError, match=r"^a background refresh is in flight: call wait\(\) "
                                           r"\(or poll\(\)\) first$"):
        ref.refresh()
    gate.set()
    ref.wait()

    class Broken:
        def __iter__(self):
            raise OSError("disk gone")

    failing = nnkloss.Refresher(bank, model, Broken(), k=4, search_backend="torch", progress=False)
    failing.refresh_async()
    with pytest.raises(RuntimeError, match=r"^background refresh failed; the bank was left "
                                           r"unchanged$"):
        failing.wait()


def test_refresh_of_a_bank_grown_meanwhile_names_both_sizes():
    """kills refresh Refresher._swap 5 (the message's row counts)."""
    import threading

    gate = threading.Event()
    bank, model, loader = _refresh_setup(gate=gate)
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False)
    ref.refresh_async()
    bank.add(torch.zeros(1, 3), torch.tensor([0]))
    gate.set()
    with pytest.raises(RuntimeError, match=r"^the bank changed size during the refresh \(24 -> 25 "
                                           r"rows\); the new bank was discarded$"):
        ref.wait()


def test_refresher_sigma_checks():
    """sigma: a float or a 0-dim tensor, positive and finite; bools, strings, 0 and inf refused
    with the argument named (kills refresh _check_sigma 3, 5, 6, 8, 9, 14, 15)."""
    bank, model, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                            sigma=torch.tensor(2.0))
    assert ref.refresh().sigma == 2.0
    assert ref.refresh(sigma=torch.tensor(0.5, requires_grad=True)).sigma == 0.5
    for bad in (True, "1.0"):
        with pytest.raises(TypeError, match=r"^sigma must be a float or a 0-dim tensor, "
                                            rf"got {type(bad).__name__}$"):
            ref.refresh(sigma=bad)
    for bad in (0.0, float("inf")):
        with pytest.raises(ValueError, match=rf"^sigma must be positive and finite, got {bad}$"):
            ref.refresh(sigma=bad)


def test_refresher_defaults_and_argument_errors(capsys):
    """Synchronous and quiet (no progress bar) by default; wrong arguments named with their
    types (kills refresh Refresher.__init__ 4, 5, 7, 8, 10, 11, 13)."""
    bank, model, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch")
    assert isinstance(ref.request(), nnkloss.RefreshStats)
    assert "refresh: embedding" not in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"^bank must be a CentreBank, got Tensor$"):
        nnkloss.Refresher(torch.zeros(3), model, loader, k=4)
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got function$"):
        nnkloss.Refresher(bank, lambda x: x, loader, k=4)
    with pytest.raises(ValueError, match=r"^k must be a positive int, got 0$"):
        nnkloss.Refresher(bank, model, loader, k=0)


@pytest.mark.parametrize("backend, options, exc, match", [
    ("fiass", {}, ValueError, r"^search_backend must be one of"),
    ("auto", {"aproximate": "ivf"}, TypeError,
     r"^knn_options got unknown options \['aproximate'\]"),
    ("auto", {"exclude_self": False}, TypeError, r"^knn_options got unknown options"),
    ("auto", {"approximate": "IVF"}, ValueError, r"^knn_options\['approximate'\] must be one of"),
    ("torch", {"approximate": "ivf"}, ValueError, r"search_backend must be 'auto' or 'faiss'")])
def test_refresher_checks_search_options_at_construction(backend, options, exc, match):
    """A bad search backend or knn option is refused by the constructor, not by the first
    refresh after the whole set has been embedded (nor from an async refresh's thread)."""
    bank, model, loader = _refresh_setup()
    with pytest.raises(exc, match=match):
        nnkloss.Refresher(bank, model, loader, k=4, search_backend=backend, knn_options=options)


@pytest.mark.parametrize("backend, options, match", [
    ("auto", {"approximate": "hnsw", "nprobe": 4},
     r"^knn_options\['nprobe'\]=4 is an option of approximate='ivf' only; approximate='hnsw'"),
    ("auto", {"approximate": "ivf", "ef_search": 64},
     r"^knn_options\['ef_search'\]=64 is an option of approximate='hnsw' only"),
    ("torch", {"nlist": 16}, r"^knn_options\['nlist'\]=16 is an option of approximate='ivf' "
                             r"only; the exact search"),
    ("auto", {"hnsw_m": 16}, r"^knn_options\['hnsw_m'\]=16 is an option of approximate='hnsw'"),
    ("auto", {"approximate": "ivf", "nprobe": 0}, r"^knn_options\['nprobe'\] must be a positive"),
    ("auto", {"approximate": "hnsw", "hnsw_m": 1}, r"^knn_options\['hnsw_m'\] must be >= 2")])
def test_refresher_refuses_index_options_at_construction(backend, options, match):
    """An index option the chosen index does not use was accepted and ignored by every
    refresh; a bad value of one it uses failed only at the first refresh, after the whole set
    had been embedded. The constructor refuses both, naming the knn_options entry."""
    bank, model, loader = _refresh_setup()
    with pytest.raises(ValueError, match=match):
        nnkloss.Refresher(bank, model, loader, k=4, search_backend=backend, knn_options=options)


@pytest.mark.parametrize("backend, options, match", [
    ("faiss", {}, r"^search_backend='faiss' needs the faiss package"),
    ("auto", {"approximate": "ivf"}, r"^knn_options\['approximate'\]='ivf' needs the faiss "),
    ("faiss", {"approximate": "hnsw"}, r"^search_backend='faiss' needs the faiss package")])
def test_refresher_reports_a_missing_faiss_at_construction(monkeypatch, backend, options, match):
    """Without faiss, Refresher(search_backend="faiss") or an approximate knn option was
    accepted and failed at the first refresh, after embedding the whole training set."""
    import nnkloss.bank.search.faiss_search as FS
    monkeypatch.setattr(FS, "_faiss_module", lambda: None)
    bank, model, loader = _refresh_setup()
    with pytest.raises(ImportError, match=match + r".*pip install faiss-cpu"):
        nnkloss.Refresher(bank, model, loader, k=4, search_backend=backend, knn_options=options)
    nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch")  # no faiss needed


def test_refresher_limits_and_device_argument():
    """k = N - 1 is allowed, k = N is refused with the count of other centres; a non-iterable
    loader is named; device= is accepted; no stats before the first refresh (kills refresh
    Refresher.__init__ 19, 21, 23, 24, 32, 33, 45, 56)."""
    bank, model, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, model, loader, k=23, search_backend="torch", progress=False,
                            device="cpu")
    assert ref.last_stats is None
    assert ref.refresh().k == 23 and ref.last_stats.k == 23
    with pytest.raises(ValueError, match=r"^k=24 is larger than the number of other centres "
                                         r"\(23\) in the bank$"):
        nnkloss.Refresher(bank, model, loader, k=24)
    with pytest.raises(TypeError, match=r"^loader must be an iterable of \(inputs, labels, idx\), "
                                        r"got int$"):
        nnkloss.Refresher(bank, model, 5, k=4)


def test_refresh_timings_are_durations():
    """embed_seconds and search_seconds lie within the wall time of the call (kills refresh
    Refresher._compute 31)."""
    import time

    bank, model, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False)
    t0 = time.perf_counter()
    stats = ref.refresh()
    wall = time.perf_counter() - t0
    assert 0.0 <= stats.embed_seconds <= wall and 0.0 <= stats.search_seconds <= wall


@pytest.mark.parametrize("bad, exc, match", [
    ("pairs", ValueError, r"^loader must yield \(inputs, labels, idx\) triples$"),
    ("float idx", TypeError, r"^idx must have an integer dtype, got torch.float32$"),
    ("float labels", TypeError, r"^labels must have an integer dtype, got torch.float32$"),
])
def test_refresh_names_what_the_loader_got_wrong(bad, exc, match):
    """kills refresh Refresher._embed 40, 43, 49, 50, 52 (the argument named)."""
    bank, model, _ = _refresh_setup(n=8)
    x, y, idx = torch.randn(8, 5), torch.arange(8) % 3, torch.arange(8)
    batch = {"pairs": (x, y), "float idx": (x, y, idx.float()),
             "float labels": (x, y.float(), idx)}[bad]
    ref = nnkloss.Refresher(bank, model, [batch], k=2, search_backend="torch", progress=False)
    with pytest.raises(exc, match=match):
        ref.refresh()


@pytest.mark.parametrize("n_labels", [1, 7, 9])
def test_refresh_refuses_labels_of_another_length_than_idx(n_labels):
    """One label for a batch of 8 rows was broadcast over all of them into centre_labels (the
    bank silently relabelled); another length now fails naming labels and idx, bank untouched."""
    bank, model, _ = _refresh_setup(n=8)
    before = bank_state(bank)
    x, y = torch.randn(8, 5), torch.arange(9) % 3
    ref = nnkloss.Refresher(bank, model, [(x, y[:n_labels], torch.arange(8))], k=2,
                            search_backend="torch", progress=False)
    with pytest.raises(ValueError, match=rf"^loader yielded {n_labels} labels for 8 idx"):
        ref.refresh()
    assert_bank_equal(bank, before)


def test_refresh_out_of_range_idx_reports_the_range_and_the_culprits():
    """kills refresh Refresher._embed 61-63, 72, 73 (CPU idx: checked per batch, min and max
    named)."""
    bank, model, _ = _refresh_setup(n=8)
    x, y = torch.randn(8, 5), torch.arange(8) % 3
    ref = nnkloss.Refresher(bank, model, [(x, y, torch.arange(-1, 7))], k=2, search_backend="torch",
                            progress=False)
    with pytest.raises(IndexError, match=r"^loader yielded idx outside the bank's rows 0\.\.7 "
                                         r"\(min -1, max 6\)$"):
        ref.refresh()


def test_refresh_names_a_model_output_that_is_not_a_tensor():
    """kills refresh Refresher._embed 104, 106."""

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    bank, _, loader = _refresh_setup()
    ref = nnkloss.Refresher(bank, Pair(), loader, k=4, search_backend="torch", progress=False)
    with pytest.raises(ValueError, match=r"^model output has shape <class 'tuple'>; expected "
                                         r"\(8, 3\) for this batch and bank$"):
        ref.refresh()


def test_refresh_names_the_rows_the_loader_never_yielded():
    """kills refresh Refresher._embed 134-136 (the first five missing rows)."""
    bank, model, _ = _refresh_setup(n=10)
    x, y = torch.randn(3, 5), torch.arange(3)
    ref = nnkloss.Refresher(bank, model, [(x, y, torch.tensor([0, 2, 9]))], k=2, search_backend="torch",
                            progress=False)
    with pytest.raises(ValueError, match=r"^the loader never yielded 7 of the bank's 10 rows "
                                         r"\(first missing idx: \[1, 3, 4, 5, 6\]\); the bank was "
                                         r"left unchanged$"):
        ref.refresh()


def test_refresh_progress_bar(capsys):
    """progress=False prints nothing; the bar counts batches of a sized loader and copes with
    an unsized one (kills refresh Refresher._progress 1, 2, 3, 6)."""
    bank, model, loader = _refresh_setup()
    nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch", progress=False).refresh()
    assert capsys.readouterr().err == ""
    batches = list(iter(loader))
    nnkloss.Refresher(bank, model, batches, k=4, search_backend="torch", progress=True).refresh()
    assert "0/3" in capsys.readouterr().err
    nnkloss.Refresher(bank, model, loader, k=4, search_backend="torch",
                      progress=True).refresh()  # no __len__
    err = capsys.readouterr().err
    assert "refresh: embedding" in err and "/3" not in err


def test_refresh_passes_tuple_and_dict_inputs_to_the_model():
    """Structured inputs reach the model intact (kills refresh _to_device 6-8, 10-12, 14)."""

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 3)

        def forward(self, inputs):
            a, b = (inputs["a"], inputs["b"]) if isinstance(inputs, dict) else inputs
            return self.lin(a) + self.lin(b)

    bank, _, _ = _refresh_setup(n=8)
    x, y, idx = torch.randn(8, 5), torch.arange(8) % 3, torch.arange(8)
    for inputs in ((x, 2 * x), [x, 2 * x], {"a": x, "b": 2 * x}):
        model = Two()
        nnkloss.Refresher(bank, model, [(inputs, y, idx)], k=2, search_backend="torch",
                          progress=False).refresh()
        with torch.no_grad():
            torch.testing.assert_close(bank.centres, model(inputs))


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_refresh.py (issue 14 promises; issue 19).
# "The bank changed size during the refresh": a background refresh computed for N rows is
# refused by a bank that now has more; a refresh of an unchanged bank is swapped in.
import time  # noqa: E402


class GatedLoader:
    """Yields (x, y, idx) batches; each iteration first signals ``started`` and then waits
    for ``go``, so a test can act while a background refresh is surely under way."""

    def __init__(self, x, y, batch=8):
        self.x, self.y, self.batch = x, y, batch
        self.started, self.go = threading.Event(), threading.Event()

    def __iter__(self):
        self.started.set()
        assert self.go.wait(30), "test never released the loader"
        for lo in range(0, len(self.y), self.batch):
            idx = torch.arange(lo, min(lo + self.batch, len(self.y)))
            yield self.x[idx], self.y[idx], idx

    def __len__(self):
        return -(-len(self.y) // self.batch)


def gated_setup(n=24, d=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    y = torch.arange(n) % 3
    torch.manual_seed(0)
    model = nn.Linear(5, d)
    bank = CentreBank(torch.randn(n, d, generator=g), y.clone(),
                      neighbours=torch.randint(0, n, (n, 3), generator=g))
    loader = GatedLoader(x, y)
    return bank, model, loader


@pytest.mark.parametrize("finish", ["wait", "poll"])
def test_bank_grown_during_async_refresh_is_refused(finish):
    bank, model, loader = gated_setup()
    refresher = Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                          async_mode=True)
    refresher.refresh_async()
    assert loader.started.wait(30)  # the worker sized its new bank at 24 rows
    bank.add(torch.zeros(2, 4), torch.tensor([0, 1]))
    grown = {k: v.clone() for k, v in bank.state_dict().items()}
    loader.go.set()
    with pytest.raises(RuntimeError, match="changed size during the refresh"):
        if finish == "wait":
            refresher.wait()
        else:
            deadline = time.monotonic() + 30
            while refresher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
    assert not refresher.in_flight
    for k, v in bank.state_dict().items():  # the grown bank is kept as it was
        assert torch.equal(v, grown[k]), k
    assert bank.num_centres == 26


def test_async_refresh_of_an_unchanged_bank_is_swapped_in():
    bank, model, loader = gated_setup()
    refresher = Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                          async_mode=True)
    refresher.refresh_async()
    loader.go.set()
    stats = refresher.wait()
    assert stats is not None and stats.asynchronous and stats.num_rows == 24
    with torch.no_grad():
        want = model(loader.x)
    torch.testing.assert_close(bank.centres, want)
    assert bank.k == 4 and not (bank.neighbours == torch.arange(24)[:, None]).any()


def test_async_refresh_of_a_batch_norm_model_matches_sync():
    """In async mode the snapshot (the model's structure, its weights loaded at each request)
    is folded for its pass as the live model is in a synchronous refresh
    (nnkloss/inference.py): the same bank for the same weights, the snapshot reusable."""
    x, y = make_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, D))
    for _ in range(3):
        model(x * 3 + 1)
    sync_bank, async_bank = make_bank(), make_bank()
    sync = Refresher(sync_bank, model, make_loader(x, y), k=6, search_backend="torch",
                     progress=False)
    ref = Refresher(async_bank, model, make_loader(x, y), k=6, search_backend="torch",
                    progress=False, async_mode=True)
    for _ in range(2):  # the second request reloads the live weights into the same snapshot
        sync.refresh()
        ref.request()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        ref.wait()
        assert torch.equal(async_bank.centres, sync_bank.centres)
        assert torch.equal(async_bank.neighbours, sync_bank.neighbours)
    assert model.training


@pytest.mark.parametrize("elems", [8, 1 << 18])
def test_refresh_distance_means_in_steps_equal_the_whole_tensor(monkeypatch, elems):
    """The refresh statistics' means, taken a few rows at a time on CPU tensors (one step
    here with the default, many with 8 elements a step: a ragged last step too), are those
    of the whole tensor; padding (inf) and NaN entries are left out of both means."""
    from nnkloss.bank import refresh as refresh_module
    monkeypatch.setattr(refresh_module, "STATS_ELEMS", elems)
    g = torch.Generator().manual_seed(5)
    d = torch.rand(37, 5, generator=g, dtype=torch.float32) * 20
    d[3, 4], d[10, :], d[36, 0] = float("inf"), float("inf"), float("nan")
    finite = torch.isfinite(d)
    vals = d[finite].double()
    mean_d, mean_k = refresh_module._distance_means(d, 1.5)
    assert mean_d == pytest.approx(float(vals.mean()), rel=1e-6)
    assert mean_k == pytest.approx(float(torch.exp(-vals / (2 * 1.5 ** 2)).mean()), rel=1e-6)
    assert refresh_module._distance_means(d, None) == (pytest.approx(mean_d), None)
    none_finite = torch.full((4, 3), float("inf"))
    assert refresh_module._distance_means(none_finite, 1.0) == (0.0, 0.0)
    assert refresh_module._distance_means(d[:0], 1.0) == (0.0, 0.0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_refresh_reads_narrow_integer_idx_as_bank_rows(dtype):
    """A loader's idx of any integer dtype names bank rows (torch's indexing would read uint8
    as a boolean mask and refuse int16)."""
    x, y = make_data()
    model = make_model()
    banks = []
    for idx_dtype in (torch.long, dtype):
        loader = [(x[i:i + 16], y[i:i + 16], torch.arange(i, i + 16).to(idx_dtype))
                  for i in range(0, N, 16)]
        bank = make_bank()
        Refresher(bank, model, loader, k=4, search_backend="torch", progress=False).refresh()
        banks.append(bank)
    assert torch.equal(banks[0].centres, banks[1].centres)
    assert torch.equal(banks[0].centre_labels, banks[1].centre_labels)


class _FakeCudaStream:
    """A stand-in ``torch.cuda.Stream`` (CPU-only machines): records what waited on what."""

    def __init__(self, device=None, name="side"):
        self.device = torch.device(device)
        self.name = name
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other)

    def synchronize(self):
        pass


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    """torch.cuda's streams stood in for, as torch answers them: current_stream refuses a
    non-CUDA device (ValueError "Expected a cuda device"), record_stream a tensor that is not
    on the stream's device (a CPU tensor: torch has no CPU kernel for it). Yields the main
    streams handed out (device -> stream) and the record_stream calls."""
    mains, recorded = {}, []

    def current_stream(device=None):
        device = torch.device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return mains.setdefault(device, _FakeCudaStream(device, "main"))

    def record_stream(self, stream):
        if self.device != stream.device:
            raise NotImplementedError("record_stream: the tensor is not on the stream's device")
        recorded.append((self, stream))

    monkeypatch.setattr(torch.cuda, "Stream", _FakeCudaStream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return mains, recorded


def test_async_refresh_of_a_cpu_bank_beside_a_cuda_model_is_swapped_in(monkeypatch,
                                                                       fake_cuda_streams):
    """A model on a GPU (the Refresher's device) embeds on a side stream of that GPU; the bank
    may stay on the CPU (embeddings are stored on the bank's device). The swap asked for the
    current stream of the centres' device, the CPU, and torch refused it: every background
    refresh of such a bank failed at poll()/wait(). The training stream now waits for the side
    stream of the model's device, and only tensors on that device are recorded on it. The
    GPU is stood in for (CUDA stand-ins: fake_cuda_streams; the inputs stay where they are);
    tests/test_refresh.py's cuda test below runs the same on a GPU."""
    from nnkloss.bank import refresh as refresh_mod
    monkeypatch.setattr(refresh_mod, "to_device", lambda inputs, device: inputs)
    mains, recorded = fake_cuda_streams
    x, y = make_data()
    model = make_model()
    sync_bank, async_bank = make_bank(), make_bank()
    Refresher(sync_bank, model, make_loader(x, y), k=6, search_backend="torch",
              progress=False).refresh()
    ref = Refresher(async_bank, model, make_loader(x, y), k=6, search_backend="torch",
                    progress=False, device="cuda", async_mode=True)
    thread_args = []

    class Thread(threading.Thread):  # the side stream handed to the worker, kept by the test
        def __init__(self, *a, **kw):  # (a finished Thread drops its own _args)
            thread_args.append(kw.get("args"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(refresh_mod.threading, "Thread", Thread)
    ref.request()
    side = thread_args[-1][3]
    assert isinstance(side, _FakeCudaStream) and side.device == torch.device("cuda")
    assert ref.wait() is not None
    assert torch.equal(async_bank.centres, sync_bank.centres)
    assert torch.equal(async_bank.neighbours, sync_bank.neighbours)
    assert mains[torch.device("cuda")].waited_for[-1] is side  # training waits for the side
    assert recorded == []  # CPU tensors: nothing for the GPU's allocator


@pytest.mark.cuda
def test_async_refresh_of_a_cpu_bank_beside_a_cuda_model_on_a_gpu():
    """The stand-in test above on a GPU: a CUDA model, a CPU bank, a background refresh."""
    x, y = make_data()
    model = make_model()
    sync_bank, async_bank = make_bank(), make_bank()
    Refresher(sync_bank, model, make_loader(x, y), k=6, search_backend="torch",
              progress=False).refresh()
    model.cuda()
    ref = Refresher(async_bank, model, make_loader(x, y), k=6, search_backend="torch",
                    progress=False, async_mode=True)
    ref.request()
    assert ref.wait() is not None
    assert async_bank.centres.device.type == "cpu"
    torch.testing.assert_close(async_bank.centres, sync_bank.centres, rtol=1e-4, atol=1e-5)


# ============================================================================ BatchNorm recalibration
def _conv_bn_net(seed=0, dim=8):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 9, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, dim))


def _images(n=256, seed=4):
    """Fabricated 12x12 images in [0, 1] (as pixels are), a bright class-dependent square."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.rand(n, 1, 12, 12, generator=g) * 0.5
    for c in range(4):
        r, col = divmod(c, 2)
        x[y == c, :, 6 * r:6 * r + 6, 6 * col:6 * col + 6] += 0.5
    return x, y


def _train_mode_cosine(model, bank, x, y, batch_size=32):
    """Mean cosine between each row's training-mode embedding (batch statistics, shuffled
    batches as training draws them) and its bank centre; the model is left as it was."""
    probe = copy.deepcopy(model).train()
    cos = []
    with torch.no_grad():
        for _, _, idx in make_loader(x, y, shuffle=True, batch_size=batch_size):
            cos.append(nn.functional.cosine_similarity(probe(x[idx]), bank.centres[idx]))
    return float(torch.cat(cos).mean())


@pytest.mark.parametrize("recalibrate", [True, 4, False])
def test_refresh_bank_lives_in_the_training_networks_space(recalibrate):
    """At step 0 of a from-scratch BatchNorm network the bank's centres agree with the rows'
    training-mode embeddings (mean cosine >= 0.95) when the refresh recalibrates the running
    statistics (whole loader, or its first 4 batches); off, the eval-mode network normalises
    with the identity statistics and the bank lives elsewhere."""
    x, y = _images()
    model = _conv_bn_net()
    bank = make_bank(len(y), 8)
    ref = Refresher(bank, model, make_loader(x, y, shuffle=False, batch_size=32), k=8,
                    search_backend="torch", recalibrate_bn=recalibrate)
    stats = ref.refresh()
    cosine = _train_mode_cosine(model, bank, x, y)
    if recalibrate:
        assert cosine >= 0.95 and stats.recalibrate_seconds > 0
        assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    else:
        assert cosine < 0.9 and stats.recalibrate_seconds == 0
    assert model.training and all(m.training for m in model.modules())


def test_recalibration_is_the_average_of_batch_statistics_and_spares_frozen_norms():
    """The running mean is the mean of the loader's batch means (momentum None meanwhile,
    then restored); a BatchNorm in eval mode (frozen) keeps its statistics."""
    from nnkloss.bank.refresh import recalibrate_batch_norms
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 5), nn.BatchNorm1d(5), nn.Linear(5, 3),
                          nn.BatchNorm1d(3, momentum=0.3))
    model[3].eval()
    frozen = model[3].running_mean.clone()
    x, y = make_data()
    loader = make_loader(x, y, shuffle=False, batch_size=32)
    assert recalibrate_batch_norms(model, loader, torch.device("cpu")) == 1
    with torch.no_grad():
        means = torch.stack([model[0](x[i:i + 32]).mean(0) for i in range(0, N, 32)])
    torch.testing.assert_close(model[1].running_mean, means.mean(0))
    assert model[1].momentum == 0.1 and model[3].momentum == 0.3
    assert torch.equal(model[3].running_mean, frozen)
    with pytest.raises(ValueError, match="recalibrate_bn"):
        Refresher(make_bank(), model, loader, k=4, recalibrate_bn=0)
