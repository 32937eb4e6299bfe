"""nnkloss/losses: BankLoss (base.py: checks, lists, reduction, stats) and NeighbourKernelLoss
(neighbour_kernel.py). ClassConditionalLoss (ccml.py) has tests/test_ccml.py."""
import contextlib

import pytest
import torch

import nnkloss
from cases import nonuniform, random_bank, small_bank


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_loss_reports_its_sigma_for_logs_and_refresh_stats():
    """kernel_sigma / log_values / repr, which the Trainer reads (kills losses kernel_sigma 1,
    log_values 1 and 2, extra_repr 1)."""
    fn = nnkloss.NeighbourKernelLoss(small_bank(), sigma=1.3, reduction="sum", backend="torch")
    assert isinstance(fn.kernel_sigma(), float)
    assert fn.kernel_sigma() == pytest.approx(1.3)
    assert fn.log_values() == {"sigma": pytest.approx(1.3)}
    text = repr(fn)
    assert "sigma=1.3" in text and "learn_sigma=False" in text
    assert "reduction='sum'" in text and "backend='torch'" in text and "exclude_self=True" in text


def test_module_runs_on_the_backend_it_was_given(monkeypatch):
    """backend="triton" reaches the op: on CPU tensors without Triton's interpreter it is refused
    (not silently replaced by "auto" = torch). Kills losses rows 34."""
    bank = small_bank()
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
    bank = small_bank()
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
    fn = nnkloss.NeighbourKernelLoss(small_bank())
    assert fn.kernel_sigma() == 1.0
    assert not fn.log_sigma.requires_grad
    assert fn.reduction == "mean" and fn.backend == "auto" and fn.exclude_self
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        nnkloss.NeighbourKernelLoss(small_bank(), backend="cuda")


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


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_bank.py (issue 14 README promises; issue 19).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads(allowed_callers=("neighbours_for",)):
    """Every Tensor method that copies a value to the host raises, except when called from
    ``allowed_callers`` (the bank's CPU-only idx range check, free for CPU idx and skipped
    for CUDA idx)."""
    import sys
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    calls = []

    def guard(name):
        orig = saved[name]

        def wrapper(self, *a, **k):
            caller = sys._getframe(1).f_code.co_name
            # "in", not "==": mutmut renames functions (...neighbours_for__mutmut_orig).
            if not any(ok in caller for ok in allowed_callers):
                calls.append((name, caller))
                raise AssertionError(f"host read Tensor.{name} from {caller}()")
            return orig(self, *a, **k)
        return wrapper

    for name in HOST_READS:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def forward_backward_without_sync(device, backend, guard):
    bank = random_bank(N=40, D=8, K=6, weights=nonuniform(40), learn_weights=True).to(device)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.5, learn_sigma=True, backend=backend).to(device)
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(7, 8, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 40, (7,), generator=g).to(device)
    labels = bank.labels[idx].clone()
    # Value checks off: since issue 18 they compare labels with bank.labels[idx] (one read).
    with guard(), nnkloss.value_checks(False):
        loss = fn(emb, labels, idx)
        loss.backward()
        fn.last_num_counted  # noqa: B018 - a 0-dim tensor, not read
    for t in (emb.grad, bank.log_weights.grad, fn.log_sigma.grad):
        assert t is not None and torch.isfinite(t).all()
    return loss


def test_forward_and_backward_read_no_tensor_values_on_cpu():
    loss = forward_backward_without_sync("cpu", "torch", no_host_reads)
    assert torch.isfinite(loss)


def test_host_read_guard_catches_a_read():
    bank = random_bank()
    fn = nnkloss.NeighbourKernelLoss(bank)
    idx = torch.arange(4)
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            fn(torch.randn(4, 6), bank.labels[idx], idx).item()
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            fn.kernel_sigma()  # what a careless forward (extra_repr style) would do


@pytest.mark.cuda
def test_forward_and_backward_never_sync_on_cuda():
    @contextlib.contextmanager
    def sync_error():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    loss = forward_backward_without_sync("cuda", "auto", sync_error)
    assert torch.isfinite(loss.cpu())


def test_fp16_embeddings_through_the_module():
    bank = random_bank(N=20, D=6, K=5)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.2)
    idx = torch.arange(0, 20, 2)
    emb = (bank.centres[idx] + 0.3).half()
    got = fn(emb, bank.labels[idx], idx)
    want = fn(emb.float(), bank.labels[idx], idx)
    torch.testing.assert_close(got, want)
