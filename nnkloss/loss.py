"""NeighbourKernelLoss: the nn.Module wrapper around the functional op and a CentreBank."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .bank import CentreBank
from .checks import BACKENDS, REDUCTIONS, check_batch, check_inputs, check_sigma
from .functional import LossOutput, loss_unchecked

__all__ = ["NeighbourKernelLoss"]


class NeighbourKernelLoss(nn.Module):
    """Drop-in loss: ``loss = NeighbourKernelLoss(bank)(emb, labels, idx)``.

    Args:
        bank: the :class:`CentreBank` (a submodule: ``.to()`` and ``state_dict()`` include it).
        sigma: initial kernel width (> 0).
        learn_sigma: learn sigma (stored as ``log_sigma``, so it stays positive).
        learn_weights: if not None, switch the bank's per-centre weights to learned (True) or
            fixed (False). The paper learns them for classification, fixes them for metric
            learning.
        reduction: "mean" (over rows with a same-class neighbour), "sum" or "none".
        backend: "auto", "triton" or "torch" (see :func:`nnkloss.neighbour_kernel_loss`).
        exclude_self: drop each example's own centre from its list (the paper's rule).

    ``forward(emb, labels, idx)``: emb (B, D), labels (B,) int, idx (B,) int bank rows of the
    batch examples. After each call ``last_stats`` holds the :class:`LossOutput` (per-row
    losses, which rows are counted, ``num_nonfinite``); ``last_num_valid`` is the count of
    counted rows as a 0-dim tensor. A NaN/inf embedding (or a distance beyond fp32) makes its
    row's loss NaN and so the mean NaN: a diverging run shows. No host synchronisation happens
    in ``forward`` for CUDA ``idx``.
    """

    def __init__(self, bank: CentreBank, sigma: float = 1.0, learn_sigma: bool = False,
                 learn_weights=None, reduction: str = "mean", backend: str = "auto",
                 exclude_self: bool = True):
        super().__init__()
        if not isinstance(bank, CentreBank):
            raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_sigma(sigma, torch.device("cpu"))  # raises on <= 0, inf, nan
        self.bank = bank
        log_sigma = torch.tensor(math.log(float(sigma)), dtype=torch.float32,
                                 device=bank.centres.device)
        self.log_sigma = nn.Parameter(log_sigma, requires_grad=learn_sigma)
        if learn_weights is not None:
            bank.learn_weights = bool(learn_weights)
        self.reduction = reduction
        self.backend = backend
        self.exclude_self = exclude_self
        self.last_stats: LossOutput | None = None

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    @property
    def last_num_valid(self):
        return None if self.last_stats is None else self.last_stats.num_valid

    def forward(self, emb: Tensor, labels: Tensor, idx: Tensor) -> Tensor:
        bank = self.bank
        check_batch(emb, labels, idx)
        nb = bank.neighbours_for(idx, self.exclude_self)
        labels = labels.to(emb.device)  # a no-op when already there
        weights = bank.weights_for_loss()
        check_inputs(emb, labels, bank.centres, bank.labels, nb, weights, self.reduction,
                     self.backend)
        # Bank contents were validated when written and sigma is exp(.) > 0, so no value
        # checks (and no host sync) here.
        out = loss_unchecked(emb, labels, bank.centres, bank.labels, nb, weights,
                             self.sigma.reshape(()), self.reduction, self.backend)
        self.last_stats = LossOutput(out.loss.detach(), out.per_row.detach(), out.valid)
        return out.loss

    def extra_repr(self) -> str:
        return (f"sigma={float(self.sigma):.4g}, learn_sigma={self.log_sigma.requires_grad}, "
                f"reduction={self.reduction!r}, backend={self.backend!r}, "
                f"exclude_self={self.exclude_self}")
