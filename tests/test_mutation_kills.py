"""Tests written for mutants that survived the mutation check of the core (issue 14,
tests/MUTATION.md, "Run on the final core"). Each one asserts a promised behaviour that no
test checked before; the comment names the mutants it kills."""
import pytest
import torch

import nnkloss
from nnkloss.checksum import load_checked, save_checked


# ----------------------------------------------------------------------- nnkloss.ops.reference
def test_empty_bank_with_trainable_centres():
    """N = 0 with centres and sigma that require grad: empty / zero gradients, no crash
    (kills reference.centre_grad 14: the early return on an empty bank tested shape[1])."""
    emb = torch.randn(3, 4, requires_grad=True)
    centres = torch.empty(0, 4, requires_grad=True)
    sigma = torch.tensor(1.0, requires_grad=True)
    out = nnkloss.neighbour_kernel_loss_with_stats(
        emb, torch.tensor([0, 1, 0]), centres, torch.empty(0, dtype=torch.long),
        torch.full((3, 2), -1), None, sigma, backend="torch")
    assert float(out.loss.detach()) == 0.0
    ge, gc, gs = torch.autograd.grad(out.loss, [emb, centres, sigma])
    assert torch.equal(ge, torch.zeros(3, 4))
    assert gc.shape == (0, 4)
    assert float(gs.detach()) == 0.0


def test_empty_bank_with_trainable_weights():
    """Bug found by the test above: with weights that require grad, the backward scattered the
    (all-padding) rows' zero gradients into an empty weight tensor at index 0: IndexError."""
    emb = torch.randn(3, 4, requires_grad=True)
    weights = torch.empty(0, requires_grad=True)
    loss = nnkloss.neighbour_kernel_loss(
        emb, torch.tensor([0, 1, 0]), torch.empty(0, 4), torch.empty(0, dtype=torch.long),
        torch.full((3, 2), -1), weights, backend="torch")
    ge, gw = torch.autograd.grad(loss, [emb, weights])
    assert torch.equal(ge, torch.zeros(3, 4))
    assert gw.shape == (0,)


def test_nonfinite_row_reaches_the_gradient_of_a_one_centre_bank():
    """A NaN embedding row makes the centre gradient NaN ("never silent"), also when the bank
    holds a single centre (where every finite row has p = p^R and contributes exactly 0).
    Kills reference.centre_grad 16 (a one-centre bank returned a zero gradient)."""
    emb = torch.tensor([[0.5, -1.0], [float("nan"), 0.0]], requires_grad=True)
    centres = torch.tensor([[1.0, 2.0]], requires_grad=True)
    with nnkloss.value_checks(False):
        out = nnkloss.neighbour_kernel_loss_with_stats(
            emb, torch.tensor([3, 3]), centres, torch.tensor([3]), torch.tensor([[0, 0], [0, -1]]),
            backend="torch")
    assert torch.isnan(out.loss)
    (gc,) = torch.autograd.grad(out.loss, [centres], retain_graph=True)
    assert torch.isnan(gc).all()
    # The finite row alone: loss 0 and a zero (not NaN) centre gradient.
    (gc0,) = torch.autograd.grad(out.per_row[0], [centres])
    assert torch.equal(gc0, torch.zeros(1, 2))


# ----------------------------------------------------------------------- nnkloss.losses
def _bank(N=12, D=3, K=4, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    bank = nnkloss.CentreBank(torch.randn(N, D, generator=g), torch.arange(N) % 3, **kw)
    bank.rebuild_neighbours(K, search_backend="torch")
    return bank


def test_loss_reports_its_sigma_for_logs_and_refresh_stats():
    """kernel_sigma / log_values / repr, which the Trainer reads (kills losses kernel_sigma 1,
    log_values 1 and 2, extra_repr 1)."""
    fn = nnkloss.NeighbourKernelLoss(_bank(), sigma=1.3, reduction="sum", backend="torch")
    assert isinstance(fn.kernel_sigma(), float)
    assert fn.kernel_sigma() == pytest.approx(1.3)
    assert fn.log_values() == {"sigma": pytest.approx(1.3)}
    text = repr(fn)
    assert "sigma=1.3" in text and "learn_sigma=False" in text
    assert "reduction='sum'" in text and "backend='torch'" in text and "exclude_self=True" in text


def test_module_runs_on_the_backend_it_was_given(monkeypatch):
    """backend="triton" reaches the op: on CPU tensors without Triton's interpreter it is refused
    (not silently replaced by "auto" = torch). Kills losses rows 34."""
    bank = _bank()
    idx = torch.arange(5)
    emb = bank.centres[idx] + 0.1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        nnkloss.NeighbourKernelLoss(bank, backend="triton")(emb, bank.labels[idx], idx)
    assert torch.isfinite(nnkloss.NeighbourKernelLoss(bank, backend="torch")(emb, bank.labels[idx],
                                                                             idx))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_applies_its_reduction(reduction):
    """The module's reduction and its last_stats (kills losses BankLoss.forward 23: reduction
    dropped -> "mean"; 28: last_stats.loss None)."""
    bank = _bank()
    idx = torch.arange(8)
    emb = bank.centres[idx] + 0.3
    rows = nnkloss.NeighbourKernelLoss(bank, sigma=0.7, reduction="none")(emb, bank.labels[idx], idx)
    assert rows.shape == (8,)
    valid = nnkloss.NeighbourKernelLoss(bank, sigma=0.7).last_stats  # nothing before a call
    assert valid is None
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=0.7, reduction=reduction)
    got = fn(emb, bank.labels[idx], idx)
    counted = fn.last_stats.counted
    assert int(counted.sum()) >= 2 and float(rows.sum()) > 0
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted.sum()}[reduction]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fn.last_stats.loss, got.detach())
    torch.testing.assert_close(fn.last_stats.per_row, rows)


def test_module_defaults_and_backend_error():
    """Documented defaults (sigma 1.0, sigma fixed) and the error naming a bad backend (kills
    losses NeighbourKernelLoss.__init__ 1, 2, 15)."""
    fn = nnkloss.NeighbourKernelLoss(_bank())
    assert fn.kernel_sigma() == 1.0
    assert not fn.log_sigma.requires_grad
    assert fn.reduction == "mean" and fn.backend == "auto" and fn.exclude_self
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        nnkloss.NeighbourKernelLoss(_bank(), backend="cuda")


class _CountEntries(nnkloss.BankLoss):
    """A minimal BankLoss subclass: each row's loss is the number of entries left in its list."""

    def rows(self, emb, labels, neighbours):
        per_row = (neighbours >= 0).sum(1).to(emb.dtype)
        return per_row, torch.ones_like(per_row, dtype=torch.bool)


def test_bank_loss_template_defaults_and_errors():
    """BankLoss, the public base class: the own centre is excluded by default and the reduction
    defaults to the mean; a bad bank is named with its type (kills losses BankLoss.__init__ 3,
    6, 13)."""
    bank = nnkloss.CentreBank(torch.randn(4, 2), torch.tensor([0, 0, 1, 1]),
                              neighbours=torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]]))
    fn = _CountEntries(bank)
    assert fn.last_stats is None and fn.last_num_counted is None
    loss = fn(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert float(loss) == 1.0  # own entry dropped from both lists, mean of [1, 1]
    assert int(fn.last_num_counted) == 2
    keep = _CountEntries(bank, reduction="sum", exclude_self=False)
    assert float(keep(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([0, 2]))) == 4.0
    with pytest.raises(TypeError, match="bank must be a CentreBank, got Tensor"):
        _CountEntries(torch.zeros(3))


# ----------------------------------------------------------------------- checkpoint, atomic
def test_save_into_a_missing_directory_names_path(tmp_path):
    """kills atomic.atomic_write 1 (the default argument name in the error)."""
    bank = _bank()
    with pytest.raises(FileNotFoundError, match=r"^path '.*nodir.*': directory .* does not exist"):
        nnkloss.save_bank(bank, tmp_path / "nodir" / "bank.pt")


def test_atomic_write_stages_a_hidden_tmp_file_beside_the_target(tmp_path):
    """While the data is written, the only new entry of the target's directory is a hidden
    ``.NAME.*.tmp`` file (never a partial NAME, nor a file a ``*.pt`` glob would pick up); it is
    in the same directory, so the final rename never crosses a file system. Kills
    atomic.atomic_write 12, 13, 14."""
    from nnkloss.atomic import atomic_write

    seen = []

    def write(f):
        seen.extend(sorted(p.name for p in tmp_path.iterdir()))
        f.write(b"new")

    (tmp_path / "a.pt").write_bytes(b"old")
    atomic_write(tmp_path / "a.pt", write)
    assert len(seen) == 2 and seen[1] == "a.pt", seen
    assert seen[0].startswith(".a.pt.") and seen[0].endswith(".tmp"), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]
    assert (tmp_path / "a.pt").read_bytes() == b"new"


def test_atomic_write_of_bytes_keeps_the_target_mode(tmp_path):
    """bytes data, and an existing target's permissions kept (kills atomic.atomic_write 22, 24,
    39)."""
    import os
    from nnkloss.atomic import atomic_write

    target = tmp_path / "log.json"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    assert atomic_write(target, b"{}\n") == os.fspath(target)
    assert target.read_bytes() == b"{}\n"
    assert os.stat(target).st_mode & 0o7777 == 0o600


def test_save_bank_refuses_unloadable_values_inside_lists(tmp_path):
    """extra is checked all the way down lists and tuples, and the error says where (kills
    checkpoint._check_extra 5, 6, 7)."""
    with pytest.raises(TypeError, match=r"^extra\['runs'\]\[1\]\[0\] is a function"):
        nnkloss.save_bank(_bank(), tmp_path / "b.pt",
                          extra={"runs": [1, (lambda: 0, 2)], "ok": (1.5, "x", None)})
    nnkloss.save_bank(_bank(), tmp_path / "b.pt", extra={"ok": [1.5, ("x", None, True)]})
    assert nnkloss.load_bank(tmp_path / "b.pt")[2] == {"ok": [1.5, ("x", None, True)]}


def test_extra_errors_say_what_a_checkpoint_holds(tmp_path):
    """kills checkpoint._check_extra 11, 12 (key error text) and 19-21 (the list of what a
    checkpoint may hold)."""
    with pytest.raises(TypeError, match=r"^extra\['d'\] has a key of type tuple; use str or int$"):
        nnkloss.save_bank(_bank(), tmp_path / "b.pt", extra={"d": {(1, 2): 0}})
    with pytest.raises(TypeError, match=r"is a set; checkpoints hold only tensors, numbers, "
                                        r"strings, None and lists/tuples/dicts of them$"):
        nnkloss.save_bank(_bank(), tmp_path / "b.pt", extra={"s": {1}})


class _Evil:
    pass


def test_load_is_weights_only_whatever_torch_defaults_to(tmp_path, monkeypatch):
    """weights_only=True is passed explicitly: still refused where torch's own default is
    weights_only=False (torch < 2.6, which setup.py allows, or this variable). Kills
    checkpoint.load_bank 9, 12."""
    save_checked({"format": "nnkloss.CentreBank", "obj": _Evil()}, tmp_path / "evil.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        nnkloss.load_bank(tmp_path / "evil.pt")


def test_load_bank_honours_map_location_and_refuses_newer_versions(tmp_path):
    """map_location is handed to torch.load (a function is called per storage); a newer format
    version is refused; a corrupt file's error names the underlying exception. Kills
    checkpoint.load_bank 8, 11, 15, 24."""
    path = tmp_path / "b.pt"
    nnkloss.save_bank(_bank(), path)
    seen = []
    bank, step, _ = nnkloss.load_bank(path, map_location=lambda s, loc: seen.append(loc) or s)
    assert seen and set(seen) == {"cpu"} and bank.num_centres == 12
    state = load_checked(path)
    state["version"] = 2
    save_checked(state, tmp_path / "new.pt")
    with pytest.raises(ValueError, match="checkpoint version 2 is newer than this nnkloss reads"):
        nnkloss.load_bank(tmp_path / "new.pt")
    # Since issue 18 a torn file fails its checksum; junk behind a valid checksum still gets
    # torch's own error, named.
    import hashlib
    from nnkloss.checksum import MAGIC
    junk = b"PK not a zip at all"
    (tmp_path / "torn.pt").write_bytes(MAGIC + hashlib.sha256(junk).hexdigest().encode() + b"\n"
                                       + junk)
    with pytest.raises(ValueError, match=r"CentreBank checkpoint\) cannot be read safely "
                                         r"\(UnpicklingError: Weights only load failed"):
        nnkloss.load_bank(tmp_path / "torn.pt")


def test_load_bank_reads_old_files_and_names_bad_log_weights(tmp_path):
    """A file without a version (older writer) loads; a bad log_weights entry is named as the
    checkpoint's. Kills checkpoint.load_bank 25, 27, 52-54, 62, 66."""
    path = tmp_path / "b.pt"
    nnkloss.save_bank(_bank(), path)
    state = load_checked(path)
    old = dict(state)
    del old["version"]
    save_checked(old, tmp_path / "old.pt")
    assert nnkloss.load_bank(tmp_path / "old.pt")[0].num_centres == 12
    for value, exc, match in (([0.0] * 12, TypeError,
                               r"^checkpoint log_weights must be a tensor, got list$"),
                              (torch.full((12,), float("nan")), ValueError,
                               r"^checkpoint log_weights contain NaN")):
        bad = dict(state, log_weights=value)
        save_checked(bad, tmp_path / "bad.pt")
        with pytest.raises(exc, match=match):
            nnkloss.load_bank(tmp_path / "bad.pt")


def test_save_bank_argument_errors_and_version_field(tmp_path):
    """bool / float steps refused, wrong types named, the file records its format version (kills
    checkpoint.save_bank 4, 6, 15, 20, 21)."""
    bank, path = _bank(), tmp_path / "b.pt"
    for step in (True, 1.5):
        with pytest.raises(ValueError, match=rf"^step must be a non-negative int, got {step!r}$"):
            nnkloss.save_bank(bank, path, step=step)
    with pytest.raises(TypeError, match=r"^bank must be a CentreBank, got Tensor$"):
        nnkloss.save_bank(torch.zeros(3), path)
    with pytest.raises(TypeError, match=r"^extra must be a dict or None, got list$"):
        nnkloss.save_bank(bank, path, extra=[1])
    nnkloss.save_bank(bank, path, step=7)
    state = load_checked(path)
    assert state["format"] == "nnkloss.CentreBank" and state["version"] == 1
    assert nnkloss.load_bank(path)[1] == 7


# ----------------------------------------------------------------------- refresh
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


# --------------------------------------------------------------- bank (run of 2026-11-22)
def test_bank_index_and_label_widths_at_the_int32_boundary():
    """Kills centre_bank._index_dtype 2-6 and _compact_labels 4-13: int32 exactly while the
    values fit, int64 from 2**31 (and below -2**31) on."""
    from nnkloss.bank.centre_bank import _compact_labels, _index_dtype
    assert _index_dtype(2 ** 31 - 1) == torch.int32 and _index_dtype(2 ** 31) == torch.int64
    assert _compact_labels(torch.tensor([0, 2 ** 31 - 1])).dtype == torch.int32
    assert _compact_labels(torch.tensor([0, 2 ** 31])).dtype == torch.int64
    assert _compact_labels(torch.tensor([-2 ** 31, 5])).dtype == torch.int32
    assert _compact_labels(torch.tensor([-2 ** 31 - 1, 5])).dtype == torch.int64
    assert _compact_labels(torch.empty(0, dtype=torch.long)).dtype == torch.int32
    assert torch.equal(_compact_labels(torch.tensor([3, 2 ** 40])), torch.tensor([3, 2 ** 40]))


def test_log_weight_validation_names_what_is_wrong():
    """Kills centre_bank._validate_log_weights 1-3, 12, 13, 28, 29: the default name, the
    length message, the NaN / +inf and the learned -inf messages. (20 and 26, ``float("INF")``
    for ``float("inf")``, are equivalent: Python parses both.)"""
    from nnkloss.bank.centre_bank import _validate_log_weights
    with pytest.raises(ValueError, match=r"^log_weights has length 2 but the bank has 3 centres$"):
        _validate_log_weights(torch.zeros(2), 3, learned=False)
    with pytest.raises(ValueError, match=r"^log_weights contain NaN or \+inf: weights must be "
                                         r"finite and non-negative$"):
        _validate_log_weights(torch.tensor([0.0, float("inf")]), 2, learned=False)
    with pytest.raises(ValueError, match=r"^w hold zero weights \(-inf\), but learned weights "
                                         r"must be strictly positive$"):
        _validate_log_weights(torch.tensor([0.0, -float("inf")]), 2, learned=True, name="w")
    ok = torch.tensor([0.0, -float("inf")])
    assert _validate_log_weights(ok, 2, learned=False) is ok
    # 3 (found by the re-run): the shape / dtype checks name the argument too
    with pytest.raises(ValueError, match=r"^log_weights must be 1-D, got shape \(3, 1\)$"):
        _validate_log_weights(torch.zeros(3, 1), 3, learned=False)
    with pytest.raises(TypeError, match=r"^log_weights must have dtype in .*got torch.int64$"):
        _validate_log_weights(torch.zeros(3, dtype=torch.int64), 3, learned=False)


def test_bank_log_weights_are_fp32_whatever_the_default_dtype():
    """Kills centre_bank CentreBank.__init__ 65, 68 (``dtype=torch.float32`` of the uniform
    log-weights dropped): under ``torch.set_default_dtype(torch.float64)`` they became fp64,
    which the contract's fp32 weight vector does not allow for."""
    from nnkloss.bank.centre_bank import CentreBank
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        bank = CentreBank(torch.zeros(3, 2, dtype=torch.float32), torch.tensor([0, 1, 0]))
    finally:
        torch.set_default_dtype(old)
    assert bank.log_weights.dtype == torch.float32
    assert torch.equal(bank.weights, torch.ones(3))


def test_load_state_dict_applies_the_learned_rule_and_names_the_full_key():
    """Kills centre_bank CentreBank._load_from_state_dict 36 (``learned=None``: a learned bank
    accepted zero weights from a state dict) and 41 (the key's prefix dropped from the error)."""
    from nnkloss.bank.centre_bank import CentreBank

    def loss(learn):
        bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 0]), learn_weights=learn)
        return nnkloss.NeighbourKernelLoss(bank)

    sd = loss(True).state_dict()
    sd["bank.log_weights"] = torch.tensor([0.0, -float("inf"), 0.0])
    with pytest.raises(ValueError, match=r"^bank\.log_weights hold zero weights \(-inf\)"):
        loss(True).load_state_dict(sd)
    fixed = loss(False)
    fixed.load_state_dict(sd)  # a fixed bank may hold a zero weight
    assert torch.equal(fixed.bank.weights, torch.tensor([1.0, 0.0, 1.0]))
    sd["bank.log_weights"] = torch.tensor([0.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match=r"^bank\.log_weights contain NaN"):
        fixed.load_state_dict(sd)


def test_load_state_dict_reports_a_bad_entry_as_a_load_error():
    """Kills centre_bank CentreBank._load_from_state_dict 58 (``error_msgs`` not passed on: an
    entry that is not a tensor ended in an AttributeError on None instead of PyTorch's load
    error naming the entry)."""
    from nnkloss.bank.centre_bank import CentreBank
    bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 0]))
    sd = bank.state_dict()
    sd["centres"] = sd["centres"].numpy()
    with pytest.raises(RuntimeError, match=r'(?s)Error\(s\) in loading state_dict for CentreBank.*'
                                           r'"centres"'):
        bank.load_state_dict(sd)


def test_functional_sigma_defaults_to_one():
    """Kills ops.neighbour_kernel neighbour_kernel_loss 1 (default ``sigma=2.0``)."""
    g = torch.Generator().manual_seed(5)
    emb, centres = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g)
    args = (emb, torch.tensor([0, 1, 0, 1]), centres, torch.tensor([0, 1, 0, 1, 0, 1]),
            torch.tensor([[0, 1, 2], [1, 2, 3], [3, 4, 5], [5, 0, 1]]))
    torch.testing.assert_close(nnkloss.neighbour_kernel_loss(*args),
                               nnkloss.neighbour_kernel_loss(*args, sigma=1.0), rtol=0, atol=0)
    assert not torch.allclose(nnkloss.neighbour_kernel_loss(*args),
                              nnkloss.neighbour_kernel_loss(*args, sigma=2.0))


@pytest.mark.parametrize("value, ok", [("1", True), ("0", False), (None, False), ("", False)])
def test_triton_on_cpu_follows_triton_interpret(monkeypatch, value, ok):
    """Kills ops.backends _interpreting 3, 5, 6, 9 (variable name or value changed: the
    interpreter's CPU runs were refused, or allowed without it). 2, 4, 7 (default value of the
    lookup) are equivalent: an unset variable is "not 1" either way."""
    from nnkloss.ops import backends
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    if ok:
        assert backends.resolve_backend("triton", torch.device("cpu")) == "triton"
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            backends.resolve_backend("triton", torch.device("cpu"))


def test_source_checkout_maps_kernels_dir_in_process(monkeypatch, tmp_path):
    """In-process twin of test_errors.py::test_source_checkout_without_install_finds_the_kernels
    (which starts a subprocess, so it cannot run under mutmut). Kills ops.backends
    _source_tree_kernels 7 (``kernels`` looked up relative to the working directory), 38 (no
    submodule search path: ``kernels/__init__`` cannot import its own modules), 47
    (``nnkloss.kernels`` left unset) and 22-31 (the error for a checkout without kernels/)."""
    import os
    import sys
    from nnkloss.ops import backends
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(tmp_path)  # kernels/ must be found beside nnkloss/, not in the cwd
    for name in [m for m in sys.modules if m == "nnkloss.kernels" or m.startswith("nnkloss.kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(nnkloss, "kernels", None, raising=False)
    module = backends._source_tree_kernels()
    assert os.path.samefile(module.__file__, os.path.join(root, "kernels", "__init__.py"))
    assert sys.modules["nnkloss.kernels"] is module and nnkloss.kernels is module
    assert callable(module.neighbour_kernel_fwd) and callable(module.centre_grad)

    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p).endswith(
        os.path.join("kernels", "__init__.py")) else real_exists(p))
    with pytest.raises(ModuleNotFoundError, match=r"^nnkloss\.kernels is missing: reinstall "
                                                  r"nnkloss \(pip install -e \.\)$") as info:
        backends._source_tree_kernels()
    assert info.value.name == "nnkloss.kernels"


def test_reference_forward_stores_distances_by_default():
    """Kills ops.reference forward 1 (``store_dist=False`` as the default: the contract's
    default is to return the (B, K) scaled distances)."""
    from nnkloss.ops import reference
    g = torch.Generator().manual_seed(8)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    args = (emb, torch.tensor([0, 1, 0]), centres, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, -1]]), None, torch.tensor(1.5))
    dist = reference.forward(*args)[4]
    assert dist.shape == (3, 2)
    torch.testing.assert_close(dist, reference.forward(*args, store_dist=True)[4])
    torch.testing.assert_close(dist[0, 0], ((centres[0] - emb[0]) / 1.5).pow(2).sum())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp64_embeddings_take_an_fp32_sigma_exactly(backend):
    """Kills ops.reference forward 10 (``1 / sigma`` taken in sigma's fp32 instead of the fp64
    compute dtype): fp64 results must carry no fp32 rounding. A float sigma becomes an fp32
    tensor (validation.check_sigma), so this is the everyday fp64 case."""
    g = torch.Generator().manual_seed(9)
    emb = torch.randn(5, 6, generator=g, dtype=torch.float64)
    centres = torch.randn(8, 6, generator=g, dtype=torch.float64)
    # bank dtype must be one the op accepts with fp64 embeddings: fp32 centres, exact in fp64
    centres = centres.float()
    labels, cl = torch.tensor([0, 1, 0, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    nb = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 3, 5], [2, 4, 6]])
    sigma32 = torch.tensor(0.3)                          # 0.30000001192092896
    out = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, sigma=sigma32,
                                        reduction="none", backend=backend)
    s = float(sigma32)
    rows = []
    for b in range(5):
        u = ((centres[nb[b]].double() - emb[b]) / s).pow(2).sum(-1)
        pos = cl[nb[b]] == labels[b]
        rows.append(torch.logsumexp(-u / 2, 0) - torch.logsumexp((-u / 2)[pos], 0))
    torch.testing.assert_close(out, torch.stack(rows), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_contract_no_positive_row_and_padding_distances(backend):
    """CONTRACT.md 5 and 7, read directly from the forward (the op's backward masks rows whose
    upstream gradient is 0, so a NaN there never reached a test through the op). Kills
    ops.reference row_softmax 37 (an empty softmax's 0/0 made grad_x NaN for a row without a
    positive) and forward 62 (padding distances stored as 1)."""
    from nnkloss.ops import backends
    impl = backends.implementation(backend)
    g = torch.Generator().manual_seed(10)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    loss, lse_all, lse_pos, grad_x, dist = impl.forward(
        emb, torch.tensor([0, 1, 7]), centres, torch.tensor([0, 1, 0, 1, 1]),
        torch.tensor([[0, 1], [2, 3], [4, -1]]), None, torch.tensor(1.3))
    assert loss[2] == 0 and lse_pos[2] == -float("inf") and torch.isfinite(lse_all[2])
    assert torch.equal(grad_x[2], torch.zeros(4))
    assert dist[2, 1] == 0 and dist[2, 0] > 0


def test_reference_path_gathers_in_bounded_chunks(monkeypatch):
    """The plain path never builds the whole (B, K, D) gather: rows go through in chunks of
    rows_per_chunk(K, D). Kills ops.reference forward 34 (step dropped: overlapping one-row
    steps) and 36 (each chunk running to the end of the batch)."""
    from nnkloss.ops import reference
    monkeypatch.setattr(reference, "CHUNK_ELEMS", 2 * 3 * 4)     # two rows of K=3, D=4
    sizes = []
    real = reference.row_terms

    def spy(nbr, *args):
        sizes.append(nbr.shape[0])
        return real(nbr, *args)
    monkeypatch.setattr(reference, "row_terms", spy)
    g = torch.Generator().manual_seed(11)
    emb, centres = torch.randn(5, 4, generator=g), torch.randn(6, 4, generator=g)
    nb = torch.randint(0, 6, (5, 3), generator=g)
    labels, cl = torch.tensor([0, 1, 0, 1, 0]), torch.tensor([0, 1, 0, 1, 0, 1])
    out = reference.forward(emb, labels, centres, cl, nb, None, torch.tensor(1.0))
    assert sizes == [2, 2, 1]
    monkeypatch.setattr(reference, "CHUNK_ELEMS", 1 << 22)
    for a, b in zip(out, reference.forward(emb, labels, centres, cl, nb, None,
                                           torch.tensor(1.0)), strict=True):
        torch.testing.assert_close(a, b)


def test_resolve_backend_table(monkeypatch):
    """Every row of backends.resolve_backend, with its exact errors. Kills ops.backends
    resolve_backend 4-11, 14-18, 20-22, 26, 31-35, 42-47, 51-53 (on a CPU-only machine "auto"
    on CPU under the interpreter gave the same numbers through Triton, so only the choice
    itself tells them apart)."""
    from nnkloss.ops import backends
    cpu_dev, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backends, "_triton_importable", lambda: True)
    assert backends.resolve_backend("auto", cpu_dev) == "cpu"
    assert backends.resolve_backend("auto", cuda) == "triton"
    assert backends.resolve_backend("auto", meta) == "torch"
    for name in ("cpu", "torch", "triton"):
        assert backends.resolve_backend(name, cpu_dev) == name
    assert backends.resolve_backend("triton", cuda) == "triton"
    assert backends.resolve_backend("torch", cuda) == "torch"
    assert backends.resolve_backend("torch", meta) == "torch"
    with pytest.raises(RuntimeError, match=r"^backend='cpu' needs CPU tensors, got cuda$"):
        backends.resolve_backend("cpu", cuda)
    with pytest.raises(RuntimeError, match=r"^backend='triton' does not support device meta$"):
        backends.resolve_backend("triton", meta)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"^backend='triton' on CPU tensors runs only under "
                                           r"Triton's interpreter: set TRITON_INTERPRET=1 "
                                           r"before importing nnkloss$"):
        backends.resolve_backend("triton", cpu_dev)
    monkeypatch.setattr(backends, "_triton_importable", lambda: False)
    assert backends.resolve_backend("auto", cuda) == "torch"
    with pytest.raises(RuntimeError, match=r"^backend='triton' needs the triton package; "
                                           r"install it or use backend='torch'$"):
        backends.resolve_backend("triton", cuda)


def test_distances_are_stored_only_when_a_gradient_needs_them(monkeypatch):
    """The (B, K) distances are kept for the backward only when centres, weights or sigma take
    a gradient (memory: B*K per step for nothing otherwise). Kills ops.neighbour_kernel
    loss_rows_unchecked 9 and 11 (stored always / whenever grad mode is on), and 1, 2 (its
    default backend misspelt)."""
    from nnkloss.ops import neighbour_kernel as nk, reference
    seen = []
    real = reference.forward

    def spy(*args, store_dist=True, **kwargs):
        seen.append(store_dist)
        return real(*args, store_dist=store_dist, **kwargs)
    monkeypatch.setattr(reference, "forward", spy)
    g = torch.Generator().manual_seed(12)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    w, s = torch.rand(5, generator=g) + 0.5, torch.tensor(1.2)
    args = (torch.tensor([0, 1, 0]), None, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, 1]]))

    def run(e, c, ww, ss):
        labels, _, cl, nb = args
        return nk.loss_rows_unchecked(e, labels, c, cl, nb, ww, ss, backend="torch")
    run(emb.requires_grad_(True), centres, w, s)
    run(emb, centres.clone().requires_grad_(True), w, s)
    run(emb, centres, w.clone().requires_grad_(True), s)
    run(emb, centres, None, s.clone().requires_grad_(True))
    with torch.no_grad():
        run(emb, centres.clone().requires_grad_(True), w, s)
    assert seen == [False, True, True, True, False]
    labels, _, cl, nb = args
    rows, valid = nk.loss_rows_unchecked(emb.detach(), labels, centres, cl, nb, None, s)
    torch.testing.assert_close(rows, run(emb.detach(), centres, None, s)[0])


def test_stats_op_sigma_defaults_to_one():
    """Kills ops.neighbour_kernel neighbour_kernel_loss_with_stats 1 (default ``sigma=2.0``)."""
    g = torch.Generator().manual_seed(13)
    args = (torch.randn(4, 3, generator=g), torch.tensor([0, 1, 0, 1]),
            torch.randn(6, 3, generator=g), torch.tensor([0, 1, 0, 1, 0, 1]),
            torch.tensor([[0, 1, 2], [1, 2, 3], [3, 4, 5], [5, 0, 1]]))
    a = nnkloss.neighbour_kernel_loss_with_stats(*args).loss
    torch.testing.assert_close(a, nnkloss.neighbour_kernel_loss_with_stats(*args, sigma=1.0).loss,
                               rtol=0, atol=0)
    assert not torch.allclose(a, nnkloss.neighbour_kernel_loss_with_stats(*args, sigma=2.0).loss)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("emb_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_forward_outputs_are_in_the_compute_dtype(backend, emb_dtype):
    """CONTRACT.md: all five outputs in the compute dtype (fp32 for half embeddings), dist
    (B, 0) without store_dist. Kills ops.reference empty_outputs 9, 11, 13, 15 (lse buffers in
    the embedding's half dtype) and 29, 30 (dist (B, K) or (B, 1) without store_dist)."""
    from nnkloss.ops import backends
    impl = backends.implementation(backend)
    g = torch.Generator().manual_seed(14)
    emb = torch.randn(3, 4, generator=g).to(emb_dtype)
    centres = torch.randn(5, 4, generator=g)
    args = (emb, torch.tensor([0, 1, 0]), centres, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, 1]]), None, torch.tensor(1.1))
    cdt = torch.float64 if emb_dtype == torch.float64 else torch.float32
    for store, k in ((True, 2), (False, 0)):
        out = impl.forward(*args, store_dist=store)
        assert [t.dtype for t in out] == [cdt] * 5
        assert [tuple(t.shape) for t in out] == [(3,), (3,), (3,), (3, 4), (3, k)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_backward_scales_rows_on_the_kernel_threads_only_for_the_cpu_backend(monkeypatch,
                                                                              backend):
    """Kills ops.neighbour_kernel _backward 32-34 (g * grad_x sent through nk_scale_rows for
    the wrong backends or for none: same numbers, other threads)."""
    from nnkloss.ops import cpu
    calls = []
    real = cpu.scale_rows

    def spy(grad_x, g):
        calls.append(grad_x.shape)
        return real(grad_x, g)
    monkeypatch.setattr(cpu, "scale_rows", spy)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 4, generator=g, requires_grad=True)
    loss = nnkloss.neighbour_kernel_loss(
        x, torch.tensor([0, 1, 0]), torch.randn(5, 4, generator=g), torch.tensor([0, 1, 0, 1, 1]),
        torch.tensor([[0, 1], [2, 3], [4, 1]]), backend=backend)
    loss.backward()
    assert calls == ([(3, 4)] if backend == "cpu" else [])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_half_precision_sigma_is_widened_before_use(backend):
    """A 0-dim fp16 sigma tensor is taken at its exact value in the compute dtype, in the
    forward and in the backward. Kills ops.neighbour_kernel _backward 57 (1 / sigma taken in
    fp16 for the centre gradient)."""
    g = torch.Generator().manual_seed(16)
    emb = torch.randn(4, 5, generator=g)
    centres = torch.randn(7, 5, generator=g)
    args = (torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 0, 1, 0, 1, 0]),
            torch.tensor([[0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]]))
    s16 = torch.tensor(0.3, dtype=torch.float16)
    res = []
    for s in (s16, torch.tensor(float(s16))):
        c = centres.clone().requires_grad_(True)
        loss = nnkloss.neighbour_kernel_loss(emb, args[0], c, args[1], args[2], sigma=s,
                                             backend=backend)
        loss.backward()
        res.append((loss, c.grad))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=1e-6, atol=1e-7)


def test_implementation_table():
    """Kills ops.backends implementation 1-8, 15, 16 (the Triton branch is otherwise exercised
    only by the interpreter tests, which the mutation runs leave out)."""
    from nnkloss.ops import backends, cpu, reference
    k = backends.kernels()
    tri = backends.implementation("triton")
    assert tri.forward is k.neighbour_kernel_fwd and tri.centre_grad is k.centre_grad
    assert backends.implementation("cpu") is cpu
    assert backends.implementation("torch") is reference
    with pytest.raises(ValueError, match=r"^backend must be one of .*'triton'.*'cpu'.*'torch'.* "
                                         r"here, got 'auto'$"):
        backends.implementation("auto")


def test_cpu_library_is_built_once_per_process(monkeypatch):
    """Kills ops.cpu _lib 15-18 (the "tried" flag not set: every call rebuilt and reloaded
    the library)."""
    import warnings
    from nnkloss.ops import cpu
    builds = []
    real = cpu._build_and_load

    def counting():
        builds.append(1)
        return real()
    monkeypatch.setattr(cpu, "_build_and_load", counting)
    cpu._reset_for_tests()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # no compiler: the notice is not the point
            first = cpu.available()
            assert [cpu.available() for _ in range(3)] == [first] * 3
    finally:
        cpu._reset_for_tests()
    assert builds == [1]
