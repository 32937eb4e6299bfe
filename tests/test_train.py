"""Trainer: the loss goes down on easy data; resume continues the log and the state exactly."""
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnkloss import CentreBank, NeighbourKernelLoss
from nnkloss.experiment.datasets import IndexedTensorDataset
from nnkloss.experiment.evaluate import extract_embeddings
from nnkloss.experiment.models import SoftmaxHead
from nnkloss.bank.refresh import Refresher, RefreshSchedule
from nnkloss.experiment.train import Trainer, fit


def blobs(n_per=24, classes=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=g) * 2.0
    y = torch.arange(classes).repeat_interleave(n_per)
    x = means[y] + torch.randn(len(y), dim, generator=g)
    return x, y


def mlp(dim_in=8, dim=6, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim_in, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, dim))


def kernel_setup(model, ds, k=12, sigma=1.0, every_epochs=1, every_steps=None):
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=sigma)
    ordered = DataLoader(ds, batch_size=32, shuffle=False)
    refresher = Refresher(bank, model, ordered, k=k, backend="torch", progress=False)
    return loss, refresher, RefreshSchedule(every_epochs=every_epochs, every_steps=every_steps)


def test_kernel_loss_decreases_and_logs(tmp_path):
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, schedule = kernel_setup(model, ds)
    loader = DataLoader(ds, batch_size=16, shuffle=True)
    calls = []

    def eval_fn(m, crit, epoch):
        assert not m.training
        emb, lab = extract_embeddings(m, DataLoader(ds, batch_size=50))
        calls.append(epoch)
        return {"emb_norm": float(emb.norm(dim=1).mean())}

    tr = fit(model, loss, loader, epochs=6, optimizer="adam", lr=3e-3, refresher=refresher,
             schedule=schedule, out_dir=str(tmp_path), progress=False, eval_fn=eval_fn,
             eval_every=2)
    h = tr.history
    assert [r["epoch"] for r in h] == list(range(1, 7))
    assert h[-1]["loss"] < 0.5 * h[0]["loss"]
    assert calls == [2, 4, 6]
    assert "refresh_time_s" in h[0] and "refresh_positive_share" in h[0]  # initial build
    assert "refresh_time_s" in h[1] and "refresh_time_s" not in h[-1]  # not after the last
    assert 0 < h[0]["valid_frac"] <= 1 and h[0]["sigma"] == pytest.approx(1.0)
    rows = json.load(open(tmp_path / "log.json"))
    assert len(rows) == 6 and rows[-1]["emb_norm"] > 0
    csv_lines = open(tmp_path / "log.csv").read().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("epoch,step,loss")
    assert os.path.isfile(tmp_path / "checkpoint.pt")


def test_softmax_head_decreases():
    x, y = blobs(seed=1)
    ds = IndexedTensorDataset(x, y)
    model = mlp(seed=1)
    head = SoftmaxHead(6, 4)
    tr = Trainer(model, head, DataLoader(ds, batch_size=16, shuffle=True), optimizer="sgd",
                 lr=0.05, progress=False)
    h = tr.fit(5)
    assert h[-1]["loss"] < 0.5 * h[0]["loss"]
    assert "sigma" not in h[0]
    # The head's parameters are trained with the network (same group).
    assert any(p is head.fc.weight for p in tr.optimizer.param_groups[0]["params"])


def test_sigma_and_weight_groups():
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=2.0, learn_sigma=True, learn_weights=True)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, backend="torch",
                          progress=False)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher, lr=0.01,
                 sigma_lr=0.1, weights_lr=0.5, progress=False)
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["sigma"]["lr"] == 0.1 and groups["sigma"]["weight_decay"] == 0.0
    assert groups["weights"]["lr"] == 0.5 and groups["weights"]["params"][0] is bank.log_weights
    tr.fit(1)
    assert float(loss.sigma.detach()) != 2.0
    assert not torch.equal(bank.log_weights.detach(), torch.zeros(len(ds)))


def test_kernel_loss_needs_a_refresher():
    bank = CentreBank(torch.zeros(4, 2), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="refresher"):
        Trainer(nn.Linear(3, 2), NeighbourKernelLoss(bank), [], progress=False)


def _run(out_dir, epochs, model_seed=0):
    x, y = blobs(seed=2)
    ds = IndexedTensorDataset(x, y)
    model = mlp(seed=model_seed)
    loss, refresher, schedule = kernel_setup(model, ds, every_epochs=2)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16, shuffle=True), optimizer="sgd",
                 lr=0.05, refresher=refresher, schedule=schedule, out_dir=str(out_dir), seed=7,
                 progress=False)
    tr.fit(epochs)
    return tr


def test_resume_continues_log_and_state(tmp_path):
    straight = _run(tmp_path / "a", 4)
    first = _run(tmp_path / "b", 3)
    log3 = json.load(open(tmp_path / "b" / "log.json"))
    assert [r["epoch"] for r in log3] == [1, 2, 3]
    # A new process: different initial weights, everything restored from the checkpoint.
    resumed = _run(tmp_path / "b", 4, model_seed=123)
    assert resumed.epoch == 4 and resumed.step == straight.step
    log4 = json.load(open(tmp_path / "b" / "log.json"))
    assert [r["epoch"] for r in log4] == [1, 2, 3, 4]
    for key in ("loss", "step"):
        assert [r[key] for r in log4[:3]] == [r[key] for r in log3]  # not overwritten
    assert len(open(tmp_path / "b" / "log.csv").read().splitlines()) == 5
    for (name, p), q in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    sb, rb = straight.criterion.bank, resumed.criterion.bank
    assert torch.equal(sb.centres, rb.centres) and torch.equal(sb.neighbours, rb.neighbours)
    assert [r["loss"] for r in straight.history] == pytest.approx([r["loss"] for r in log4],
                                                                  rel=1e-6)
    # Asking for what is already done changes nothing.
    again = _run(tmp_path / "b", 4, model_seed=5)
    assert len(again.history) == 4
    assert first.epoch == 3


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    tr = _run(tmp_path, 1)
    before = open(tmp_path / "checkpoint.pt", "rb").read()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        tr.save_checkpoint()
    assert open(tmp_path / "checkpoint.pt", "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "log.csv", "log.json"]


def test_async_refresher_swaps_in_during_training():
    x, y = blobs(seed=3)
    ds = IndexedTensorDataset(x, y)
    model = mlp(seed=3)
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=1.0)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, backend="torch",
                          progress=False, async_mode=True)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=8, shuffle=True), optimizer="adam",
                 lr=3e-3, refresher=refresher, schedule=RefreshSchedule(every_steps=4),
                 progress=False)
    h = tr.fit(3)
    assert not refresher.in_flight  # settled at the end
    assert any(r.get("refresh_asynchronous") for r in h)
    assert h[-1]["loss"] < h[0]["loss"]


def test_trainer_drives_refreshes_through_its_schedule(tmp_path):
    """The RefreshSchedule the Trainer ships is the one it uses: its counters advance with the
    loop, refreshes happen exactly when it fires, and its state is in the checkpoint."""
    x, y = blobs(n_per=8)
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, schedule = kernel_setup(model, ds, k=6, every_epochs=2, every_steps=3)
    fired = []
    real_refresh = refresher.refresh
    refresher.refresh = lambda sigma=None: fired.append(schedule.global_step) or real_refresh(sigma)
    loader = DataLoader(ds, batch_size=16, shuffle=False)  # 2 steps per epoch
    tr = Trainer(model, loss, loader, lr=1e-3, refresher=refresher, schedule=schedule,
                 out_dir=str(tmp_path), progress=False)
    tr.fit(4)
    assert tr.schedule is schedule
    assert (schedule.epoch, schedule.global_step) == (4, 8)
    # Initial build (step 0); steps 3 and 6; end of epoch 2 (step 4); none after the last.
    assert fired == [0, 3, 4, 6]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["schedule"] == schedule.state_dict()
    fresh = RefreshSchedule(every_epochs=2, every_steps=3)
    tr2 = Trainer(model, loss, loader, lr=1e-3, refresher=refresher, schedule=fresh,
                  out_dir=str(tmp_path), progress=False)
    tr2.load_checkpoint()
    assert (fresh.epoch, fresh.global_step) == (4, 8)


def test_trainer_refuses_a_schedule_it_cannot_drive():
    x, y = blobs(n_per=4)
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, _ = kernel_setup(model, ds, k=3)
    with pytest.raises(TypeError, match="schedule must be a nnkloss.RefreshSchedule"):
        Trainer(model, loss, DataLoader(ds), refresher=refresher, schedule=object())
