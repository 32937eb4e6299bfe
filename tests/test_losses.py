"""nnkloss/losses: BankLoss (base.py: checks, lists, reduction, stats) and NeighbourKernelLoss
(neighbour_kernel.py). ClassConditionalLoss (ccml.py) has tests/test_ccml.py."""
import pytest
import torch

import nnkloss
from cases import small_bank


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
