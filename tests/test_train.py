"""Trainer: the loss goes down on easy data; resume continues the log and the state exactly."""
import copy
import functools
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
from nnkloss.experiment import checkpoint as ckpt
from nnkloss.experiment.train import Trainer, fit
from nnkloss.bank.search import neighbour_lists


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
    refresher = Refresher(bank, model, ordered, k=k, search_backend="torch", progress=False)
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
    # Each refresh its own columns: the initial build's are not overwritten by the epoch's.
    assert "start_refresh_time_s" in h[0] and "start_refresh_positive_share" in h[0]
    assert h[0]["start_refresh_recalibrate_seconds"] == 0  # a network without BatchNorm
    assert all("start_refresh_time_s" not in r for r in h[1:])
    assert "end_refresh_time_s" in h[0] and "end_refresh_time_s" not in h[-1]  # not the last
    assert 0 < h[0]["counted_frac"] <= 1 and h[0]["sigma"] == pytest.approx(1.0)
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


def test_threads_set_torchs_count_for_the_run_and_restore_it():
    """Trainer(threads=n) runs fit at n torch threads (the initial steps included) and gives
    torch its count back; None leaves it; anything else is refused naming threads."""
    x, y = blobs(seed=1)
    ds = IndexedTensorDataset(x, y)
    seen = []

    class Probe(SoftmaxHead):
        def forward(self, emb, labels, idx=None):
            seen.append(torch.get_num_threads())
            return super().forward(emb, labels, idx)
    saved = torch.get_num_threads()
    for threads, want in ((1, 1), (None, saved)):
        seen.clear()
        Trainer(mlp(seed=1), Probe(6, 4), DataLoader(ds, batch_size=16), progress=False,
                threads=threads).fit(1)
        assert seen and set(seen) == {want} and torch.get_num_threads() == saved
    for bad in ("auto", 0, True, 1.5):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            Trainer(mlp(), SoftmaxHead(6, 4), DataLoader(ds), progress=False, threads=bad)
    for name in ("eval_every", "checkpoint_every", "log_every"):  # ints, as for threads
        for bad in (0, 2.0, True):
            with pytest.raises(ValueError, match=f"{name} must be a positive int"):
                Trainer(mlp(), SoftmaxHead(6, 4), DataLoader(ds), progress=False, **{name: bad})


def test_sigma_and_weight_groups():
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone(), learn_weights=True)
    loss = NeighbourKernelLoss(bank, sigma=2.0, learn_sigma=True)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, search_backend="torch",
                          progress=False)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher, lr=0.01,
                 sigma_lr=0.1, weights_lr=0.5, progress=False)
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["sigma"]["lr"] == 0.1 and groups["sigma"]["weight_decay"] == 0.0
    assert groups["weights"]["lr"] == 0.5 and groups["weights"]["params"][0] is bank.log_weights
    tr.fit(1)
    assert loss.kernel_sigma() != 2.0
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
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, search_backend="torch",
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
    state = ckpt.load(tmp_path / "checkpoint.pt")
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


# ---------------------------------------------------------------- resume checks (issue 18)
class _RunsCode:
    """Unpickling this runs a command (what a crafted checkpoint.pt did before issue 18)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_runs_no_code_from_the_checkpoint(tmp_path):
    """A checkpoint.pt holding a pickled callable is refused, with or without a valid
    checksum (anyone who can write the file can compute one); the command never runs."""
    from nnkloss.checksum import save_checked
    tr = _run(tmp_path, 1)
    marker = tmp_path / "pwned"
    state = tr.state_dict()
    state["history"] = [_RunsCode(marker)]
    for write in (lambda: save_checked(state, tmp_path / "checkpoint.pt"),
                  lambda: torch.save(state, tmp_path / "checkpoint.pt")):
        write()
        with pytest.raises(ValueError, match="checkpoint.pt"):
            _run(tmp_path, 2)
        assert not marker.exists()


def test_format_2_checkpoint_is_refused_saying_why(tmp_path):
    """Format 3 (issue 19) names the bank's centre labels "centre_labels" (the criterion's
    state dict, the data record's sha256); a format-2 checkpoint is refused with an error that
    says so, before anything is loaded."""
    from nnkloss.checksum import load_checked, save_checked
    _run(tmp_path, 1)
    state = load_checked(tmp_path / "checkpoint.pt")
    assert state["format"] == "nnkloss.trainer/3"
    assert "centre_labels_sha256" in state["data"] and "labels_sha256" not in state["data"]
    assert "bank.centre_labels" in state["criterion"]
    old = dict(state, format="nnkloss.trainer/2")
    save_checked(old, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"Trainer checkpoint of format 'nnkloss.trainer/2', "
                                         r"which named the bank's centre labels 'labels'; this "
                                         r"nnkloss reads format 'nnkloss.trainer/3' only"):
        _run(tmp_path, 2)


def test_checkpoint_loads_weights_only():
    """Everything the Trainer saves (RNG states included) is what the default weights-only
    unpickler reads, with no allow-list; the RNG states restore exactly."""
    import io
    import random
    import numpy as np
    x, y = blobs(n_per=4)
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, schedule = kernel_setup(model, ds, k=3)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=8), optimizer="adam", lr=1e-3,
                 refresher=refresher, schedule=schedule, progress=False)
    tr.fit(1)
    np.random.randn()                       # a cached Gaussian in NumPy's state too
    random.gauss(0.0, 1.0)
    buf = io.BytesIO()
    torch.save(tr.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    def draws():
        return (random.random(), random.gauss(0.0, 1.0), float(np.random.randn()),
                float(torch.rand(())))
    first = draws()
    ckpt.set_rng_state(state["rng"])
    assert draws() == first
    assert state["data"]["num_centres"] == 16 and state["data"]["embedding_dim"] == 6


def test_cuda_rng_states_of_gpus_this_machine_lacks_are_left_out(monkeypatch):
    """A checkpoint holds the CUDA RNG state of every GPU its writer saw (rank 0 of an 8-GPU
    job: eight). torch.cuda.set_rng_state_all sets device i's state for the i-th one, and on a
    machine with fewer GPUs device i does not exist (torch: IndexError from its
    default_generators, raised at once where CUDA is initialised, at CUDA's initialisation
    otherwise): the resume was refused. The GPUs are stood in for here (torch's
    set_rng_state_all as written, over a set_rng_state that refuses a device past the count)."""
    set_devices = []

    def set_one(new_state, device):
        if device >= 2:
            raise IndexError("tuple index out of range")
        set_devices.append(device)

    state = ckpt.rng_state()  # this machine's (no GPU: no "cuda" entry)
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_one)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: [set_one(s, i) for i, s in enumerate(states)])
    ckpt.set_rng_state(state)
    assert set_devices == [0, 1]


def _data_run(out_dir, n_per=24, dim=6, permute=False, epochs=1):
    x, y = blobs(n_per=n_per, seed=2)
    if permute:
        y = y.flip(0)
    ds = IndexedTensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, dim))
    bank = CentreBank(torch.zeros(len(ds), dim), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=1.0)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=6, search_backend="torch",
                          progress=False)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), lr=1e-3, refresher=refresher,
                 out_dir=str(out_dir), progress=False)
    tr.fit(epochs)
    return tr


def test_resume_on_other_data_is_refused_naming_what_differs(tmp_path):
    """A checkpoint of 96 training rows resumed on 80 (before issue 18 that trained on, with
    the old bank), on other labels, or with another embedding size: an error naming it,
    before anything is loaded."""
    _data_run(tmp_path, epochs=1)
    saved = open(tmp_path / "checkpoint.pt", "rb").read()
    for kwargs, match in (({"n_per": 20}, r"N \(training examples, bank rows\): 96 in the "
                                          r"checkpoint, 80 now"),
                          ({"permute": True}, "labels"),
                          ({"dim": 5}, "embedding size: 6 in the checkpoint, 5 now")):
        with pytest.raises(ValueError, match=match) as info:
            _data_run(tmp_path, epochs=2, **kwargs)
        assert "checkpoint.pt" in str(info.value)
        assert open(tmp_path / "checkpoint.pt", "rb").read() == saved  # nothing trained
    assert _data_run(tmp_path, epochs=2).epoch == 2                     # the same data resumes


def test_optimiser_state_of_another_shape_is_refused_on_load(tmp_path):
    """Optimizer.load_state_dict checks parameter groups, not the buffers: a momentum buffer of
    another shape (its sha256 recomputed) loaded, then failed at the next step mid-run. Now
    the resume is refused naming the buffer, and nothing is trained from it."""
    from nnkloss.checksum import load_checked, save_checked
    _data_run(tmp_path, epochs=1)
    path = tmp_path / "checkpoint.pt"
    good = load_checked(path)
    state = good["optimizer"]["state"]
    key = next(k for k in state[0] if state[0][k].dim() > 0)  # Adam's exp_avg
    for bad in (torch.zeros(1), torch.zeros(2, *state[0][key].shape), state[0][key].t()):
        state[0][key] = bad
        save_checked(good, path)
        saved = path.read_bytes()
        with pytest.raises(ValueError, match=rf"checkpoint.pt'?, optimizer: the optimiser "
                                             rf"state '{key}' of parameter 0 of its group has "
                                             rf"shape \({bad.shape[0]},"):
            _data_run(tmp_path, epochs=2)
        assert path.read_bytes() == saved  # nothing trained, nothing written
    state[0][key] = state[0][key].t().contiguous()
    save_checked(good, path)
    assert _data_run(tmp_path, epochs=2).epoch == 2


def test_optimiser_hyperparameters_the_constructor_would_refuse_are_refused_on_load(tmp_path):
    """Optimizer.load_state_dict takes a group's lr, momentum, weight decay as they come: a NaN
    one trained to NaN parameters without an error (audit A), a string failed mid-run. Each is
    refused on load, naming the group and the key, and nothing is trained from it."""
    from nnkloss.checksum import load_checked, save_checked
    from nnkloss.experiment.checkpoint import check_optimizer_state
    _data_run(tmp_path, epochs=1)
    path = tmp_path / "checkpoint.pt"
    good = load_checked(path)
    for key, value in (("lr", float("nan")), ("lr", -1.0), ("lr", "0.1"), ("lr", None),
                       ("momentum", float("nan")), ("weight_decay", float("inf"))):
        groups = [dict(g, **{key: value}) for g in good["optimizer"]["param_groups"]]
        save_checked(dict(good, optimizer=dict(good["optimizer"], param_groups=groups)), path)
        saved = path.read_bytes()
        with pytest.raises(ValueError, match=rf"checkpoint.pt'?, optimizer: .*parameter group 0's "
                                             rf"'{key}' must be a number finite and >= 0"):
            _data_run(tmp_path, epochs=2)
        assert path.read_bytes() == saved
    adam = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=0.1)
    check_optimizer_state(adam)  # its defaults (betas a tuple, amsgrad a bool) pass
    adam.param_groups[0]["betas"] = (0.9, float("nan"))
    with pytest.raises(ValueError, match=r"'betas' must be numbers finite and >= 0"):
        check_optimizer_state(adam)
    adam.param_groups[0]["betas"] = (0.9, 0.999)
    adam.param_groups[0]["lr"] = torch.tensor(0.01)  # torch takes a tensor lr
    check_optimizer_state(adam)
    save_checked(good, path)
    assert _data_run(tmp_path, epochs=2).epoch == 2


def test_a_history_the_logs_cannot_write_is_refused_on_load(tmp_path):
    """The history is written to log.json / log.csv after each epoch: a loaded one holding
    what they cannot write (bytes, a tuple key, a list holding itself) failed at the first
    write, mid-run, and one list shared 2^28 times over made that write all but endless;
    json.dumps also fails on nesting 2,000 deep, and a history is refused beyond 32 levels
    (40 here). Each is refused on load, naming the history; nested metrics as an eval_fn
    returns them load and are written."""
    from nnkloss.checksum import load_checked, save_checked
    from nnkloss.experiment.checkpoint import check_history
    _data_run(tmp_path, epochs=1)
    path = tmp_path / "checkpoint.pt"
    good = load_checked(path)
    loop = []
    loop.append(loop)
    shared = [1.0]
    for _ in range(28):
        shared = [shared, shared]
    deep = [1.0]
    for _ in range(40):
        deep = [deep]
    for value, match in ((b"\x00", "holds a bytes"), ({(1, 2): 0.5}, "a key of type tuple"),
                         (loop, r"holds itself \(a cycle\)"),
                         (deep, "nests deeper than 32 levels"),
                         (shared, "expands to more than 10000000 values")):
        state = dict(good, history=[dict(good["history"][0], extra=value)])
        save_checked(state, path)
        with pytest.raises(ValueError, match=rf"checkpoint.pt'?, history .*{match}"):
            _data_run(tmp_path, epochs=2)
    for bad in ({"epoch": 1}, [[1]], [{1: 2}]):
        with pytest.raises(ValueError, match="must be a list of dicts with str keys"):
            check_history(bad)
    nested = dict(good["history"][0], recall={1: 0.5, 2: torch.tensor(0.7)}, ks=(1, 2),
                  twice=[[1.0, 2.0]] * 3)  # a small list shared three times: fine
    save_checked(dict(good, history=[nested]), path)
    run = _data_run(tmp_path, epochs=2)
    assert run.epoch == 2 and run.history[0]["recall"][1] == 0.5
    logged = json.load(open(tmp_path / "log.json"))[0]
    assert logged["ks"] == [1, 2] and logged["recall"]["2"] == pytest.approx(0.7)


def test_an_amp_scaler_state_its_constructor_would_refuse_is_refused_on_load(tmp_path):
    """GradScaler.load_state_dict takes any numbers: a NaN scale skipped every later step
    without an error. The state is checked as the constructor checks its arguments (and the
    scale finite and positive); a disabled scaler's empty state loads."""
    from nnkloss.checksum import load_checked, save_checked
    _data_run(tmp_path, epochs=1)
    path = tmp_path / "checkpoint.pt"
    good = load_checked(path)
    assert good["scaler"] == {}   # CPU: AMP off
    ok = torch.amp.GradScaler("cpu").state_dict()
    for key, value, rule in (("scale", float("nan"), "finite and > 0"),
                             ("scale", 0.0, "finite and > 0"),
                             ("growth_factor", 1.0, "finite and > 1"),
                             ("backoff_factor", 1.5, r"in \(0, 1\)"),
                             ("growth_interval", 0, "an int >= 1"),
                             ("growth_interval", float("inf"), "an int >= 1, got inf"),
                             ("_growth_tracker", -1, "an int >= 0"),
                             ("_growth_tracker", float("inf"), "an int >= 0, got inf"),
                             ("scale", "big", "a number")):
        save_checked(dict(good, scaler=dict(ok, **{key: value})), path)
        with pytest.raises(ValueError, match=rf"checkpoint.pt'?, scaler\['{key}'\] must be "
                                             rf"{rule}"):
            _data_run(tmp_path, epochs=2)
    save_checked(dict(good, scaler=ok), path)   # valid (unused by a CPU run)
    assert _data_run(tmp_path, epochs=2).epoch == 2


def test_every_trainer_checkpoint_field_is_named_in_its_error(tmp_path):
    """A missing or mistyped epoch, step, schedule or RNG state (or a bank_ready, refresh_due
    that is not a bool) is a ValueError naming the file and the field (a bare KeyError or
    int() message before; bool("False") was True), and nothing is loaded."""
    from nnkloss.checksum import load_checked, save_checked
    _data_run(tmp_path, epochs=1)
    path = tmp_path / "checkpoint.pt"
    good = load_checked(path)
    for field, value, match in (("epoch", "2", "must be an int >= 0, got '2'"),
                                ("step", -1, "must be an int >= 0, got -1"),
                                ("epoch", True, "must be an int >= 0, got True"),
                                ("schedule", {"epoch": 1}, "KeyError"),
                                ("rng", {"python": None}, "TypeError"),
                                ("rng", dict(good["rng"], torch=[1, 2]), "AttributeError"),
                                ("bank_ready", "False", "must be a bool, got str"),
                                ("refresh_due", torch.tensor([1, 0]), "must be a bool, got Tensor"),
                                ("rng", None, None)):
        state = dict(good, **{field: value}) if value is not None else {
            k: v for k, v in good.items() if k != field}
        save_checked(state, path)
        with pytest.raises(ValueError, match=rf"checkpoint.pt'?, {field}: .*{match or 'KeyError'}"):
            _data_run(tmp_path, epochs=2)
    for value in ("x", dict(good["optimizer"], state={0: "x"})):
        save_checked(dict(good, optimizer=value), path)
        with pytest.raises(AttributeError, match=r"checkpoint.pt'?, optimizer: 'str' object"):
            _data_run(tmp_path, epochs=2)
    save_checked(good, path)
    assert _data_run(tmp_path, epochs=2).epoch == 2


def test_flipped_bit_in_a_trainer_checkpoint_is_refused(tmp_path):
    """torch does not check its zip CRCs: before issue 18 a flipped bit in a tensor loaded
    silently. Now any flipped bit is an error naming the file."""
    _run(tmp_path, 1)
    path = tmp_path / "checkpoint.pt"
    good = path.read_bytes()
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(100, len(good), (12,), generator=g).tolist()
    positions += [len(good) - 30, 5]
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 0x10
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="checkpoint.pt"):
            _run(tmp_path, 2)
    path.write_bytes(good)
    assert _run(tmp_path, 2).epoch == 2


def test_stale_temporary_files_of_a_killed_write_are_removed(tmp_path):
    """A write killed mid-way (kill -9) leaves ``.checkpoint.pt.<random>.tmp``; the next
    resume removes it (others' files and other targets' temporaries stay)."""
    _run(tmp_path, 1)
    stale = tmp_path / ".checkpoint.pt.k9x_ab12.tmp"
    stale.write_bytes(b"half a checkpoint")
    keep = [tmp_path / ".checkpoint.pt.bak.abcdefgh.tmp", tmp_path / "notes.tmp"]
    for k in keep:
        k.write_bytes(b"x")
    tr = _run(tmp_path, 1)             # resume only (nothing left to train): still cleans
    assert tr.epoch == 1 and not stale.exists()
    assert all(k.exists() for k in keep)
    stale.write_bytes(b"half a checkpoint")
    tr.save_checkpoint()
    assert not stale.exists()



# ---------------------------------------------------------------- a bank on a moving network
def spy(obj, name, log, trainer_box):
    """Record ``trainer.step`` at every call of ``obj.name``."""
    real = getattr(obj, name)

    def wrapped(*a, **k):
        log.append(trainer_box[0].step if trainer_box else 0)
        return real(*a, **k)

    setattr(obj, name, wrapped)


def moving_setup(seed=0, every_epochs=100, every_steps=None, k=6, ensure_positive=True, **kw):
    """96 rows, unshuffled batches of 16: 6 steps per epoch in a known order."""
    x, y = blobs(seed=seed)
    ds = IndexedTensorDataset(x, y)
    model = mlp(seed=seed)
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = NeighbourKernelLoss(bank, sigma=1.0)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=k, search_backend="torch",
                          ensure_positive=ensure_positive)
    kw.setdefault("optimizer", "adam")
    kw.setdefault("lr", 3e-3)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16, shuffle=False), refresher=refresher,
                 schedule=RefreshSchedule(every_epochs=every_epochs, every_steps=every_steps),
                 progress=False, **kw)
    return tr, refresher


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_fresh_centres_write_each_step_embeddings(momentum):
    tr, refresher = moving_setup(fresh_centres=momentum)
    bank = tr.criterion.bank
    outputs = []  # the train-mode forwards (dropout on), in step order
    tr.model.register_forward_hook(
        lambda m, i, out: outputs.append(out.detach().clone()) if m.training else None)
    initial = {}
    real = refresher.refresh

    def first(sigma=None):
        stats = real(sigma)
        initial.setdefault("centres", bank.centres.clone())
        initial.setdefault("neighbours", bank.neighbours.clone())
        return stats

    refresher.refresh = first
    tr.fit(2)
    assert len(outputs) == 12
    expected = initial["centres"].clone()
    for step, out in enumerate(outputs):
        rows = torch.arange(16) + 16 * (step % 6)
        expected[rows] = momentum * expected[rows] + (1 - momentum) * out
    torch.testing.assert_close(bank.centres, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(bank.centres, initial["centres"])
    assert torch.equal(bank.neighbours, initial["neighbours"])  # lists only by option


def test_neighbours_every_steps_rebuild_from_the_bank_alone():
    tr, refresher = moving_setup(fresh_centres=0.0, neighbours_every_steps=4)
    refreshes, rebuilds = [], []
    box = [tr]
    spy(refresher, "refresh", refreshes, box)
    spy(refresher, "rebuild_neighbours", rebuilds, box)
    h = tr.fit(2)
    assert refreshes == [0] and rebuilds == [4, 8, 12]  # no re-embedding pass after step 0
    assert [r["neighbours_rebuilds"] for r in h] == [1, 2]
    for r in h:
        assert r["neighbours_time_s"] > 0 and 0.0 <= r["neighbours_overlap"] <= 1.0
        assert r["neighbours_positive_share"] == 1.0 and 0 < r["neighbours_mean_kernel"] <= 1
    bank = tr.criterion.bank  # the last rebuild (step 12) saw the last write
    expected = neighbour_lists(bank.centres, bank.centre_labels, 6, search_backend="torch",
                               ensure_positive=True).neighbours
    assert torch.equal(bank.neighbours, expected.to(bank.neighbours.dtype))


def test_neighbours_every_steps_skip_steps_a_full_refresh_covers():
    tr, refresher = moving_setup(every_steps=4, neighbours_every_steps=2)
    refreshes, rebuilds = [], []
    spy(refresher, "refresh", refreshes, [tr])
    spy(refresher, "rebuild_neighbours", rebuilds, [tr])
    tr.fit(2)
    assert refreshes == [0, 4, 8, 12] and rebuilds == [2, 6, 10]


@pytest.mark.parametrize("async_mode", [False, True])
def test_warm_start_refreshes_after_the_given_steps(async_mode):
    tr, refresher = moving_setup(warm_start_steps=3)
    if async_mode:
        refresher.async_mode = True
    syncs, starts = [], []
    spy(refresher, "refresh", syncs, [tr])
    spy(refresher, "refresh_async", starts, [tr])
    h = tr.fit(2)
    if async_mode:
        assert syncs == [0] and starts == [3]
        # Swapped in at the first poll after the thread finished: in epoch 1, or (on a loaded
        # machine) in epoch 2 or at the end of fit(); logged with that epoch.
        # (a swap at the end of an epoch is logged as end_refresh_*, at the start as start_*)
        swapped = [r.get(p + "refresh_asynchronous") for r in h
                   for p in ("start_", "", "end_")]
        assert swapped.count(True) == 1
    else:
        assert syncs == [0, 3] and starts == []
    assert "start_refresh_time_s" in h[0] and "refresh_time_s" not in h[1]
    if not async_mode:  # the warm start's columns beside the initial build's
        assert "refresh_time_s" in h[0]


def test_warm_start_steps_zero_changes_nothing():
    a, _ = moving_setup()
    b, _ = moving_setup(warm_start_steps=0)
    a.fit(1)
    b.fit(1)
    assert torch.equal(a.criterion.bank.centres, b.criterion.bank.centres)


def resume_run(setup, out_dir, epochs, model_seed=None, **kw):
    """Fit ``setup(out_dir=out_dir, **kw)[0]`` (a Trainer writing to ``out_dir``) up to ``epochs``.
    With ``model_seed``, every model parameter is first overwritten with random values, as in a
    new process: a resumed run must then take its whole state from the checkpoint."""
    tr, _ = setup(out_dir=str(out_dir), **kw)
    if model_seed is not None:  # a new process: different initial state, all from the file
        torch.manual_seed(model_seed)
        for p in tr.model.parameters():
            nn.init.normal_(p)
    tr.fit(epochs)
    return tr


_run_moving = functools.partial(resume_run, moving_setup, seed=4)


@pytest.mark.parametrize("options", [
    dict(fresh_centres=0.5, neighbours_every_steps=5, warm_start_steps=4),
    dict(fresh_centres=0.0, neighbours_every_steps=6, warm_start_steps=14, every_epochs=2),
])
def test_resume_with_bank_options_equals_straight_run(tmp_path, options):
    straight = _run_moving(tmp_path / "a", 3, **options)
    _run_moving(tmp_path / "b", 2, **options)
    resumed = _run_moving(tmp_path / "b", 3, model_seed=77, **options)
    assert resumed.step == straight.step == 18
    for part in ("model", "criterion"):
        sa = getattr(straight, part).state_dict()
        sb = getattr(resumed, part).state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert torch.equal(sa[name], sb[name]), (part, name)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    assert resumed.history[-1].get("neighbours_rebuilds") == straight.history[-1]["neighbours_rebuilds"]


def test_sigma_lr_drives_a_learned_sigma():
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    moved = {}
    for sigma_lr in (0.0, 0.1, 0.2):
        model = mlp()
        bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
        loss = NeighbourKernelLoss(bank, sigma=2.0, learn_sigma=True)
        refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, search_backend="torch")
        tr = Trainer(model, loss, DataLoader(ds, batch_size=len(ds)), optimizer="sgd",
                     momentum=0.0, lr=0.01, sigma_lr=sigma_lr, weight_decay=0.0,
                     refresher=refresher, progress=False)
        start = float(loss.log_sigma.detach())
        tr.fit(1)  # one SGD step: log_sigma moves by -sigma_lr * grad
        moved[sigma_lr] = float(loss.log_sigma.detach()) - start
        assert tr.history[-1]["sigma"] == pytest.approx(loss.kernel_sigma())
    assert moved[0.0] == 0.0 and moved[0.1] != 0.0
    assert moved[0.2] == pytest.approx(2 * moved[0.1], rel=2e-3)  # fp32 log_sigma: ulp 6e-8


@pytest.mark.parametrize("kw, exc, match", [
    (dict(fresh_centres=1.0), ValueError, "fresh_centres"),
    (dict(fresh_centres=-0.5), ValueError, "fresh_centres"),
    (dict(fresh_centres=True), TypeError, "fresh_centres"),
    (dict(fresh_centres="0.9"), TypeError, "fresh_centres"),
    (dict(neighbours_every_steps=0), ValueError, "neighbours_every_steps"),
    (dict(neighbours_every_steps=2.5), ValueError, "neighbours_every_steps"),
    (dict(warm_start_steps=-1), ValueError, "warm_start_steps"),
    (dict(warm_start_steps=1.5), ValueError, "warm_start_steps"),
])
def test_bank_options_bad_values(kw, exc, match):
    with pytest.raises(exc, match=match):
        moving_setup(**kw)


def test_bank_options_need_a_bank_loss_and_a_refresher_that_rebuilds_lists():
    x, y = blobs(n_per=4)
    ds = IndexedTensorDataset(x, y)
    for kw in (dict(fresh_centres=0.0), dict(neighbours_every_steps=3), dict(warm_start_steps=2)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} need a criterion with a bank"):
            Trainer(mlp(), SoftmaxHead(6, 4), DataLoader(ds), progress=False, **kw)
    loss, _, _ = kernel_setup(mlp(), ds, k=3)

    class RefreshOnly:
        def refresh(self, sigma=None):
            return None

    with pytest.raises(TypeError, match="rebuild_neighbours"):
        Trainer(mlp(), loss, DataLoader(ds), refresher=RefreshOnly(), neighbours_every_steps=2,
                progress=False)


@pytest.mark.cuda
def test_fresh_centres_under_amp_write_the_fp32_embeddings_the_loss_saw():
    tr, _ = moving_setup(fresh_centres=0.0, amp=True, device="cuda")
    assert tr.use_amp
    seen = []
    forward = tr.criterion.forward

    def spy_forward(emb, labels, idx):
        seen.append((emb.detach().clone(), idx.clone()))
        return forward(emb, labels, idx)

    tr.criterion.forward = spy_forward
    tr.fit(1)
    bank = tr.criterion.bank
    assert all(e.dtype == torch.float32 for e, _ in seen) and len(seen) == 6
    for emb, idx in seen:  # unshuffled: every row written once, in its own step
        assert torch.equal(bank.centres[idx], emb)


def _group_ids(tr):
    return {g["name"]: [id(p) for p in g["params"]] for g in tr.optimizer.param_groups}


def test_optimiser_groups_come_from_the_loss_not_from_names():
    """The Trainer asks the criterion's parameter_groups() which parameter is sigma / the
    bank's weights: a subclass parameter whose *name* ends in log_weights is still "other"
    (network group, weight decay), which matching by name got wrong."""
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()

    class Scaled(NeighbourKernelLoss):
        def __init__(self, bank, **kw):
            super().__init__(bank, **kw)
            self.scale_log_weights = nn.Parameter(torch.zeros(()))  # a name, not a role

        def rows(self, emb, labels, neighbours):
            return super().rows(emb * self.scale_log_weights.exp(), labels, neighbours)

    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone(), learn_weights=True)
    loss = Scaled(bank, sigma=1.0, learn_sigma=True)
    declared = loss.parameter_groups()
    assert declared["sigma"] == [loss.log_sigma] and declared["weights"] == [bank.log_weights]
    assert declared["other"] == [loss.scale_log_weights]
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, search_backend="torch",
                          progress=False)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher,
                 optimizer="adamw", lr=1e-3, weight_decay=0.1, sigma_lr=0.5, weights_lr=0.25,
                 progress=False)
    ids = _group_ids(tr)
    assert ids["sigma"] == [id(loss.log_sigma)] and ids["weights"] == [id(bank.log_weights)]
    assert ids["network"] == [id(p) for p in model.parameters()] + [id(loss.scale_log_weights)]
    by_name = {g["name"]: g for g in tr.optimizer.param_groups}
    assert by_name["sigma"]["lr"] == 0.5 and by_name["weights"]["lr"] == 0.25
    assert by_name["sigma"]["weight_decay"] == by_name["weights"]["weight_decay"] == 0.0
    assert by_name["network"]["weight_decay"] == 0.1


def test_optimiser_groups_of_fixed_sigma_softmax_and_plain_modules():
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, schedule = kernel_setup(model, ds)  # fixed sigma, fixed weights
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher,
                 schedule=schedule, progress=False)
    assert [g["name"] for g in tr.optimizer.param_groups] == ["network"]  # nothing else trains
    head = SoftmaxHead(6, 4)
    plain = nn.Linear(6, 4)  # no parameter_groups(): every parameter is a network parameter
    for crit in (head, plain):
        tr = Trainer(model, crit, DataLoader(ds, batch_size=16), progress=False)
        assert _group_ids(tr) == {"network": [id(p) for p in model.parameters()]
                                  + [id(p) for p in crit.parameters()]}


def test_optimiser_groups_refuse_a_loss_that_forgets_a_parameter():
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher, schedule = kernel_setup(model, ds)
    loss.extra = nn.Parameter(torch.ones(()))
    loss.parameter_groups = lambda: {"sigma": [loss.log_sigma], "weights": [], "other": []}
    with pytest.raises(ValueError, match=r"parameter_groups\(\) leaves out .*extra"):
        Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher,
                progress=False)
    loss.parameter_groups = lambda: {"sigma": [loss.log_sigma], "temperature": [loss.extra]}
    with pytest.raises(ValueError, match="unknown groups"):
        Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher,
                progress=False)


class _Recording(NeighbourKernelLoss):
    """Records whether value checks were on at each call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checks = []

    def forward(self, emb, labels, idx):
        from nnkloss.validation import value_checks_enabled
        self.checks.append(value_checks_enabled())
        return super().forward(emb, labels, idx)


def _recording_setup(ds, model):
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    loss = _Recording(bank, sigma=1.0)
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=8, search_backend="torch",
                          progress=False)
    return loss, refresher


def test_value_checks_run_in_the_first_step_of_each_fit_only():
    """The hot loop runs without value checks (no host sync for them) after each fit()'s
    first step; a caller who switched them off keeps them off for that step too."""
    import nnkloss
    x, y = blobs()
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher = _recording_setup(ds, model)
    tr = Trainer(model, loss, DataLoader(ds, batch_size=16), refresher=refresher,
                 progress=False)
    tr.fit(2)
    assert loss.checks == [True] + [False] * 11  # 6 batches per epoch
    tr.fit(3)
    assert loss.checks[12:] == [True] + [False] * 5
    from nnkloss.validation import value_checks_enabled
    assert value_checks_enabled()  # the caller's setting is back
    loss.checks.clear()
    with nnkloss.value_checks(False):
        tr.fit(4)
    assert loss.checks == [False] * 6


class _MisalignedAfter(torch.utils.data.Dataset):
    """Items whose idx names another class's bank row (24 rows on) from item ``start``."""

    def __init__(self, ds, start):
        self.ds, self.start = ds, start

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y, idx = self.ds[i]
        return x, y, (idx + 24) % len(self.ds) if i >= self.start else idx


def test_misaligned_rows_raise_in_the_first_step_or_at_the_epoch_end():
    x, y = blobs()  # 4 classes of 24 consecutive rows: idx + 24 is always another class
    ds = IndexedTensorDataset(x, y)
    model = mlp()
    loss, refresher = _recording_setup(ds, model)
    bad_first = DataLoader(_MisalignedAfter(ds, 0), batch_size=16)
    tr = Trainer(model, loss, bad_first, refresher=refresher, progress=False)
    with pytest.raises(ValueError, match="idx"):
        tr.fit(1)
    assert tr.step == 0  # refused before the first optimiser step
    loss, refresher = _recording_setup(ds, model)
    bad_later = DataLoader(_MisalignedAfter(ds, 16), batch_size=16)  # aligned first batch
    tr = Trainer(model, loss, bad_later, refresher=refresher, progress=False)
    with pytest.raises(ValueError, match=r"epoch 1: .* in 80 training rows .*idx"):
        tr.fit(1)
    assert tr.step == 6 and tr.history == []  # the epoch ran (rows dropped), was not logged


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_train.py (issue 14 Trainer promises; issue 19): asynchronous
# refreshes swapped in during training, grad_clip, amp, adamw, checkpoint_every, resume with an
# asynchronous refresher and learned sigma / weights, a bank with learned weights that grows.
# blobs is the one above (n_per=16 given where the file's default was used).
from nnkloss.experiment.checkpoint import load as load_checkpoint_file  # noqa: E402


def mlp16(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 6))


def kernel_trainer(seed=0, *, learn=False, async_mode=False, schedule=None, k=8, n_per=16,
                   **kw):
    x, y = blobs(n_per=n_per, seed=seed)
    ds = IndexedTensorDataset(x, y)
    model = mlp16(seed)
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


class WithIdleParameter(nn.Module):
    """An MLP plus a parameter whose gradient is exactly zero (present, but all zeros)."""

    def __init__(self):
        super().__init__()
        self.net = mlp16(4)
        self.idle = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return self.net(x) + 0.0 * self.idle.sum()


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_adamw_decays_decoupled_from_the_gradient(optimizer):
    x, y = blobs(n_per=16, seed=4)
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


# The resume runs: resume_run (above) with this file's Trainer set-up.
run = functools.partial(resume_run, kernel_trainer, seed=6, sigma_lr=0.05, weights_lr=0.2)


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


def test_loading_a_checkpoint_settles_a_background_refresh_still_in_flight(tmp_path):
    """A fit() that fails while a background refresh runs leaves it in flight; a resume in the
    same process (fit() again, load_checkpoint) then had it swapped in at its first step, over
    the loaded bank, with centres of the model before the load. The load finishes it first."""
    tr, _ = kernel_trainer(seed=5, async_mode=True, out_dir=str(tmp_path))
    tr.fit(1)
    saved = {k: v.clone() for k, v in tr.criterion.state_dict().items()}
    with torch.no_grad():  # the failed run trained on: its refresh embeds other weights
        for p in tr.model.parameters():
            p.add_(0.5)
    tr.upkeep.refresh(wait=False)
    assert tr.refresher.in_flight
    tr.load_checkpoint()
    assert not tr.refresher.in_flight
    tr.refresher.wait()  # nothing left to swap in over the loaded bank
    for name, v in tr.criterion.state_dict().items():
        assert torch.equal(v, saved[name]), name


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
    tr.upkeep.refresh()  # embed the new rows and put them in the lists
    assert bank.num_centres == n_old + len(y_new)
    before = bank.log_weights.detach().clone()
    groups = {g["name"]: g for g in tr.optimizer.param_groups}
    assert groups["weights"]["params"][0] is bank.log_weights
    tr.fit(3)  # momentum buffers of the old size are padded, not a shape error
    moved = bank.log_weights.detach() != before
    assert moved[:n_old].any() and moved[n_old:].any()
    state = tr.optimizer.state[bank.log_weights]
    assert state["momentum_buffer"].shape == (n_old + len(y_new),)


def test_load_state_dict_is_all_or_nothing(tmp_path):
    """A checkpoint whose optimiser part is refused (after the criterion and the model loaded)
    leaves the Trainer exactly as it was: model, criterion (bank), optimiser, counters."""
    tr = _run(tmp_path / "a", 2)
    other = _run(tmp_path / "b", 3, model_seed=1)
    state = other.state_dict()
    state["optimizer"] = dict(state["optimizer"], param_groups=[])   # refused by torch
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    bank_before = {k: v.clone() for k, v in tr.criterion.state_dict().items()}
    epoch, step, n_hist = tr.epoch, tr.step, len(tr.history)
    opt_before = tr.optimizer.state_dict()["param_groups"]
    with pytest.raises(ValueError, match="optimizer"):
        tr.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in tr.model.state_dict().items())
    assert all(torch.equal(v, bank_before[k]) for k, v in tr.criterion.state_dict().items())
    assert (tr.epoch, tr.step, len(tr.history)) == (epoch, step, n_hist)
    assert tr.optimizer.state_dict()["param_groups"] == opt_before
    # the model and the criterion of `other` differ, so a partial load would have shown
    assert not all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())
    tr.load_state_dict(other.state_dict())                            # a good one still loads
    assert tr.epoch == other.epoch and tr.step == other.step


@pytest.mark.parametrize("recalibrate", [True, False])
def test_initial_bank_of_a_batch_norm_network_is_in_its_training_space(recalibrate):
    """The Trainer's initial bank of a from-scratch BatchNorm network left in eval mode by its
    owner: built from the network in its training modes with its BatchNorm statistics
    recalibrated, so that a row's training-mode embedding and its centre agree (mean cosine
    >= 0.95); without the recalibration they do not. The weights barely move (lr 1e-12) and
    no refresh follows the last epoch: the bank is the initial one. Its statistics are the
    first row's start_refresh_* columns."""
    x, y = blobs()
    x = x * 3 + 5  # inputs far from the identity statistics (mean 0, var 1)
    ds = IndexedTensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 6))
    model.eval()
    bank = CentreBank(torch.zeros(len(ds), 6), ds.labels.clone())
    refresher = Refresher(bank, model, DataLoader(ds, batch_size=32), k=12,
                          search_backend="torch", recalibrate_bn=recalibrate)
    tr = Trainer(model, NeighbourKernelLoss(bank, sigma=1.0), DataLoader(ds, batch_size=16,
                 shuffle=True), refresher=refresher, schedule=RefreshSchedule(every_epochs=1),
                 optimizer="sgd", lr=1e-12, progress=False, threads=None)
    h = tr.fit(1)
    with torch.no_grad():
        train_mode = copy.deepcopy(model).train()
        cosine = float(torch.cat([nn.functional.cosine_similarity(
            train_mode(x[idx]), bank.centres[idx]) for idx in torch.randperm(len(ds)).split(16)
        ]).mean())
    assert (cosine >= 0.95) if recalibrate else (cosine < 0.9)
    assert (h[0]["start_refresh_recalibrate_seconds"] > 0) == recalibrate
