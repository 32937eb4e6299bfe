"""Trainer promises that had no test that could fail (issue 14): asynchronous refreshes swapped
in during training, grad_clip, amp, adamw, checkpoint_every, resume with an asynchronous
refresher and learned sigma / weights, and a bank with learned weights that grows."""
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnkloss import CentreBank, NeighbourKernelLoss
from nnkloss.experiment.checkpoint import load as load_checkpoint_file
from nnkloss.experiment.datasets import IndexedTensorDataset
from nnkloss.bank.refresh import Refresher, RefreshSchedule
from nnkloss.experiment.train import Trainer


def blobs(n_per=16, classes=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=g) * 2.0
    y = torch.arange(classes).repeat_interleave(n_per)
    return means[y] + torch.randn(len(y), dim, generator=g), y


def mlp(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 6))


def kernel_trainer(seed=0, *, learn=False, async_mode=False, schedule=None, k=8, n_per=16,
                   **kw):
    x, y = blobs(n_per=n_per, seed=seed)
    ds = IndexedTensorDataset(x, y)
    model = mlp(seed)
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone(), learn_weights=learn)
    loss = NeighbourKernelLoss(bank, sigma=1.0, learn_sigma=learn)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=k, search_backend="torch",
                          progress=False, async_mode=async_mode)
    kw.setdefault("optimizer", "adam")
    kw.setdefault("lr", 3e-3)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=8, shuffle=True), refresher=refresher,
                 schedule=schedule or RefreshSchedule(every_epochs=1), progress=False,
                 seed=seed, **kw)
    return tr, ds


def all_params(tr):
    return torch.cat([p.detach().reshape(-1).double()
                      for g in tr.optimizer.param_groups for p in g["params"]])


# ---------------------------------------------------------------- asynchronous refresh
def test_async_refreshes_are_swapped_in_during_the_epoch():
    tr, _ = kernel_trainer(seed=3, async_mode=True, schedule=RefreshSchedule(every_steps=3))
    refresher = tr.refresher
    swaps, finals = [], []
    wait = refresher.wait

    def poll():  # deterministic: block until the background refresh is done
        stats = wait()
        if stats is not None:
            swaps.append(tr.step)
        return stats

    def final_wait(timeout=None):
        stats = wait(timeout)
        if stats is not None:
            finals.append(tr.step)
        return stats

    refresher.poll = poll
    refresher.wait = final_wait
    tr.fit(2)  # 64 rows / 8 = 8 steps per epoch, 16 steps
    # Requested after steps 3, 6, 9, 12, 15; each swapped in at the next step's poll.
    assert swaps == [4, 7, 10, 13, 16], (swaps, finals)
    assert not refresher.in_flight
    assert any(r.get("refresh_asynchronous") for r in tr.history)


# ---------------------------------------------------------------- grad_clip
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_grad_clip_bounds_every_step(clip):
    tr, ds = kernel_trainer(seed=1, learn=True, optimizer="sgd", momentum=0.0, lr=0.1,
                            weight_decay=0.0, grad_clip=clip)
    tr.fit(0)  # builds the bank
    before = all_params(tr)
    tr.fit(1)
    steps = tr.step
    moved = float((all_params(tr) - before).norm())
    bound = steps * 0.1 * 1e-3  # plain SGD: each step moves lr * (clipped gradient)
    if clip is None:
        assert moved > 10 * bound  # the bound below is a real constraint
    else:
        assert 0 < moved <= bound * (1 + 1e-4)
    names = {g["name"] for g in tr.optimizer.param_groups}
    assert names == {"network", "sigma", "weights"}  # sigma and weights are clipped too


# ---------------------------------------------------------------- amp
def test_amp_is_a_no_op_on_cpu_and_checkpoints(tmp_path):
    plain, _ = kernel_trainer(seed=2)
    plain.fit(2)
    amp, _ = kernel_trainer(seed=2, amp=True, out_dir=str(tmp_path))
    assert not amp.use_amp and not amp.scaler.is_enabled()
    amp.fit(2)
    assert [r["loss"] for r in amp.history] == [r["loss"] for r in plain.history]
    again, _ = kernel_trainer(seed=2, amp=True, out_dir=str(tmp_path))
    again.load_checkpoint()
    assert again.epoch == 2


@pytest.mark.cuda
def test_amp_on_cuda_runs_the_loss_in_fp32(tmp_path):
    tr, _ = kernel_trainer(seed=2, amp=True, device="cuda", out_dir=str(tmp_path))
    assert tr.use_amp and tr.scaler.is_enabled()
    dtypes = []
    forward = tr.criterion.forward

    def spy(emb, labels, idx):
        dtypes.append(emb.dtype)
        return forward(emb, labels, idx)

    tr.criterion.forward = spy
    h = tr.fit(3)
    assert set(dtypes) == {torch.float32}
    assert h[-1]["loss"] < h[0]["loss"]
    state = load_checkpoint_file(tmp_path / "checkpoint.pt")
    assert state["scaler"] and state["scaler"]["scale"] > 0


# ---------------------------------------------------------------- adamw
class WithIdleParameter(nn.Module):
    """An MLP plus a parameter whose gradient is exactly zero (present, but all zeros)."""

    def __init__(self):
        super().__init__()
        self.net = mlp(4)
        self.idle = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return self.net(x) + 0.0 * self.idle.sum()


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_adamw_decays_decoupled_from_the_gradient(optimizer):
    x, y = blobs(seed=4)
    ds = IndexedTensorDataset(x, y)
    model = WithIdleParameter()
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=1.0, learn_sigma=True)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=6, search_backend="torch",
                          progress=False)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), optimizer=optimizer, lr=0.01,
                 weight_decay=0.1, refresher=refresher, progress=False)
    decay = {g["name"]: g["weight_decay"] for g in tr.optimizer.param_groups}
    assert decay == {"network": 0.1, "sigma": 0.0}
    tr.fit(1)
    steps = tr.step
    if optimizer == "adamw":
        assert isinstance(tr.optimizer, torch.optim.AdamW)
        # Decoupled: a zero gradient leaves only the decay, p *= (1 - lr * wd) per step.
        want = torch.full((3,), 2.0) * (1 - 0.01 * 0.1) ** steps
        torch.testing.assert_close(model.idle.detach(), want, rtol=1e-6, atol=0)
    else:
        # Adam's L2 decay goes through the normalisation: full-size steps of about lr.
        assert float(model.idle.detach()[0]) < 2.0 - 0.5 * 0.01 * steps


# ---------------------------------------------------------------- checkpoint_every
def test_checkpoint_every(tmp_path):
    tr, _ = kernel_trainer(seed=5, out_dir=str(tmp_path), checkpoint_every=2)
    saved = []
    save = tr.save_checkpoint

    def spy(path=None):
        saved.append(tr.epoch)
        return save(path)

    tr.save_checkpoint = spy
    tr.fit(5)
    assert saved == [2, 4, 5]  # every 2 epochs, and the last one
    state = load_checkpoint_file(tmp_path / "checkpoint.pt")
    assert state["epoch"] == 5
    assert len(json.load(open(tmp_path / "log.json"))) == 5


# ---------------------------------------------------------------- resume
def run(out_dir, epochs, *, model_seed=None, async_mode=False, learn=False):
    tr, _ = kernel_trainer(seed=6, learn=learn, async_mode=async_mode, out_dir=str(out_dir),
                           sigma_lr=0.05, weights_lr=0.2)
    if model_seed is not None:  # a new process: different initial state, all from the file
        torch.manual_seed(model_seed)
        for p in tr.model.parameters():
            nn.init.normal_(p)
    tr.fit(epochs)
    return tr


@pytest.mark.parametrize("async_mode, learn", [(True, False), (False, True), (True, True)])
def test_resume_equals_straight_run(tmp_path, async_mode, learn):
    straight = run(tmp_path / "a", 4, async_mode=async_mode, learn=learn)
    run(tmp_path / "b", 3, async_mode=async_mode, learn=learn)
    resumed = run(tmp_path / "b", 4, model_seed=99, async_mode=async_mode, learn=learn)
    assert resumed.step == straight.step
    sd_a, sd_b = straight.criterion.state_dict(), resumed.criterion.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for name in sd_a:
        torch.testing.assert_close(sd_b[name], sd_a[name], rtol=1e-6, atol=1e-7, msg=name)
    ma, mb = straight.model.state_dict(), resumed.model.state_dict()
    assert ma.keys() == mb.keys()
    for name in ma:
        torch.testing.assert_close(mb[name], ma[name], rtol=1e-6, atol=1e-7, msg=name)
    if learn:
        assert resumed.criterion.kernel_sigma() != 1.0
        assert not torch.equal(resumed.criterion.bank.log_weights.detach(),
                               torch.zeros_like(resumed.criterion.bank.log_weights))
        groups = {g["name"]: g for g in resumed.optimizer.param_groups}
        assert groups["weights"]["params"][0] is resumed.criterion.bank.log_weights
        assert groups["sigma"]["params"][0] is resumed.criterion.log_sigma
    losses_a = [r["loss"] for r in straight.history]
    losses_b = [r["loss"] for r in resumed.history]
    assert len(losses_a) == len(losses_b) == 4
    assert losses_b == pytest.approx(losses_a, rel=1e-6)


# ---------------------------------------------------------------- growing a learned bank
def test_trainer_keeps_training_the_weights_of_a_grown_bank():
    tr, ds = kernel_trainer(seed=7, learn=True, optimizer="sgd", lr=0.05, momentum=0.9,
                            weights_lr=0.5)
    tr.fit(1)
    bank = tr.criterion.bank
    # Grow the training set by 8 examples: bank rows, refresher and training loaders.
    x_new, y_new = blobs(n_per=2, seed=70)
    x_all = torch.cat([ds.inputs, x_new])
    ds2 = IndexedTensorDataset(x_all, torch.cat([ds.labels, y_new]))
    n_old = bank.num_centres
    bank.add(torch.zeros(len(y_new), 6), y_new)
    tr.refresher.loader = DataLoader(ds2, batch_size=32)
    tr.loader = DataLoader(ds2, batch_size=8, shuffle=True)
    tr.refresh()  # embed the new rows and put them in the lists
    assert bank.num_centres == n_old + len(y_new)
    before = bank.log_weights.detach().clone()
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["weights"]["params"][0] is bank.log_weights
    tr.fit(3)  # momentum buffers of the old size are padded, not a shape error
    moved = bank.log_weights.detach() != before
    assert moved[:n_old].any() and moved[n_old:].any()
    state = tr.optimizer.state[bank.log_weights]
    assert state["momentum_buffer"].shape == (n_old + len(y_new),)
