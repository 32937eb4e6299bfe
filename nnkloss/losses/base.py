"""The contract of a loss over a :class:`CentreBank` (the template every bank loss follows).

Like pytorch-metric-learning's base loss, the template does what every such loss needs --
argument checks, the move of labels to the embeddings' device, each row's neighbour list (its
own centre excluded), the reduction, and the statistics of the last call -- so that a loss is
only its maths: :meth:`BankLoss.rows`.

What a training loop may rely on (``nnkloss.experiment.Trainer`` does): ``bank`` (to refresh),
``last_stats`` / ``last_num_valid`` (rows counted in the last mean, a 0-dim tensor: no sync),
:meth:`kernel_sigma` (for the refresh statistics) and :meth:`log_values` (per-epoch log).
"""
from __future__ import annotations

import abc
from typing import Dict, Optional, Tuple

from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..ops.neighbour_kernel import LossOutput, reduce_rows
from ..validation import REDUCTIONS, check_batch

__all__ = ["BankLoss"]


class BankLoss(nn.Module, abc.ABC):
    """Base class: ``loss = SomeBankLoss(bank, ...)(emb, labels, idx)``.

    Args:
        bank: the :class:`CentreBank` (a submodule: ``.to()`` and ``state_dict()`` include it).
        reduction: "mean" (over the counted rows), "sum" or "none" ((B,)).
        exclude_self: drop each example's own centre from its list (the papers' rule).

    ``forward(emb, labels, idx)``: emb (B, D) float, labels (B,) int, idx (B,) int bank rows of
    the batch examples. Subclasses implement :meth:`rows`.
    """

    def __init__(self, bank: CentreBank, reduction: str = "mean", exclude_self: bool = True):
        super().__init__()
        if not isinstance(bank, CentreBank):
            raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.bank = bank
        self.reduction = reduction
        self.exclude_self = bool(exclude_self)
        self.last_stats: Optional[LossOutput] = None

    @abc.abstractmethod
    def rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor) -> Tuple[Tensor, Tensor]:
        """The loss's maths: ``(per_row (B,), counted (B,) bool)`` for embeddings (B, D),
        labels (B,) on emb's device and lists (B, K) into ``self.bank`` (-1 = padding)."""

    def forward(self, emb: Tensor, labels: Tensor, idx: Tensor) -> Tensor:
        check_batch(emb, labels, idx)
        neighbours = self.bank.neighbours_for(idx, self.exclude_self)
        per_row, counted = self.rows(emb, labels.to(emb.device), neighbours)
        loss = reduce_rows(per_row, counted, self.reduction)
        self.last_stats = LossOutput(loss.detach(), per_row.detach(), counted)
        return loss

    @property
    def last_num_valid(self) -> Optional[Tensor]:
        """Rows counted in the last call's mean (0-dim tensor), None before the first call."""
        return None if self.last_stats is None else self.last_stats.num_valid

    def kernel_sigma(self) -> Optional[float]:
        """The kernel width the bank's refresh statistics use (None: not a kernel loss)."""
        return None

    def log_values(self) -> Dict[str, float]:
        """Scalars for a training log (read once per epoch: may sync)."""
        return {}
