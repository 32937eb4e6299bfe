"""NeighbourKernelLoss: the nearest-neighbour Gaussian kernel loss (Eq. 3) over a CentreBank."""
from __future__ import annotations

from typing import Tuple

from torch import Tensor

from ..bank.centre_bank import CentreBank
from ..ops.backends import backend
from ..ops.neighbour_kernel import loss_rows
from ..validation import BACKENDS
from .base import BankLoss

__all__ = ["NeighbourKernelLoss"]


class NeighbourKernelLoss(BankLoss):
    """Drop-in loss: ``loss = NeighbourKernelLoss(bank)(emb, labels, idx)``.

    Args:
        bank: the :class:`CentreBank` (a submodule: ``.to()`` and ``state_dict()`` include it).
        sigma: initial kernel width (> 0).
        learn_sigma: learn sigma (stored as ``log_sigma``, so it stays positive; read it with
            :meth:`kernel_sigma` or :meth:`sigma_tensor`).
        reduction: "mean" (over rows with a same-class neighbour), "sum" or "none".
        backend: "auto", "triton", "cpu" or "torch" (see
            :func:`nnkloss.neighbour_kernel_loss`).
        exclude_self: drop each example's own centre from its list (the paper's rule).

    ``forward(emb, labels, idx)``: emb (B, D), labels (B,) int, idx (B,) int bank rows of the
    batch examples. The per-centre weights are the bank's, learned when its ``learn_weights``
    is True (the paper learns them for classification). After each call ``last_stats`` holds
    the :class:`LossOutput` (per-row losses, counted rows, ``num_nonfinite``).

    A NaN/inf embedding makes its row's loss, and the mean, NaN, with value checks on too
    (where the functional op raises): a diverging model must show as a NaN loss the training
    loop sees, not as an exception halfway through a step, and checking would cost a host sync
    per step on a GPU. ``labels`` must equal ``bank.centre_labels[idx]`` (see
    :class:`BankLoss`).
    """

    def __init__(self, bank: CentreBank, sigma: float = 1.0, learn_sigma: bool = False,
                 reduction: str = "mean", backend: str = "auto", exclude_self: bool = True):
        super().__init__(bank, reduction, exclude_self)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self._init_sigma(sigma, learn_sigma)
        self.backend = backend

    def loss_rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor
                  ) -> Tuple[Tensor, Tensor, Tensor]:
        bank = self._modules["bank"]
        centres, centre_labels, _ = bank.loss_tensors()
        name = backend(self.backend, emb.device, emb.dtype).name
        return loss_rows(emb, labels, centres, centre_labels, neighbours,
                         bank.weights_for_loss(), self.sigma_tensor(), name, self.reduction)

    def rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor) -> Tuple[Tensor, Tensor]:
        _, per_row, counted = self.loss_rows(emb, labels, neighbours)
        return per_row, counted

    def extra_repr(self) -> str:
        return (f"sigma={self.kernel_sigma():.4g}, learn_sigma={self.log_sigma.requires_grad}, "
                f"reduction={self.reduction!r}, backend={self.backend!r}, "
                f"exclude_self={self.exclude_self}")
