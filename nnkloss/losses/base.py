"""The contract of a loss over a :class:`CentreBank` (the template every bank loss follows).

Like pytorch-metric-learning's base loss, the template does what every such loss needs --
argument checks, the move of labels to the embeddings' device, each row's neighbour list (its
own centre excluded), the reduction, and the statistics of the last call -- so that a loss is
only its maths: :meth:`BankLoss.rows`.

What a training loop may rely on (``nnkloss.experiment.Trainer`` does): ``bank`` (to refresh),
``last_stats`` / ``last_num_counted`` (rows counted in the last mean, a 0-dim tensor: no sync),
``last_num_mismatched`` (rows whose ``labels`` disagree with the bank's, a 0-dim tensor),
:meth:`kernel_sigma` (for the refresh statistics), :meth:`log_values` (per-epoch log) and
:meth:`parameter_groups` (which of its parameters are sigma, the bank's weights, or other).

Sigma, in every loss that has one: stored as the Parameter ``log_sigma`` (0-dim fp32; it
requires grad only when sigma is learned, and exp keeps a learned sigma positive); read as a
float with :meth:`kernel_sigma` (logs, refresh statistics: one host read) and as a 0-dim tensor
with :meth:`sigma_tensor` (the maths: differentiable, no host read).

Misaligned batches: ``idx`` must give each example's own bank row, so ``labels`` must equal
``bank.centre_labels[idx]``. With value checks on (``nnkloss.value_checks``, the default) a
disagreement raises, naming ``idx`` and ``labels`` (one host sync on GPU). With them off (hot
loops) or under ``torch.compile``, such rows are **dropped**: zero loss, zero gradient, left out
of the mean, and counted in ``last_stats.num_mismatched`` without a sync. Dropped rather than
used, because a row's list and its own-centre exclusion come from the bank row ``idx`` names:
for a misaligned row they belong to another example, so its loss would train on the wrong
centres. The drop empties those rows' lists (all padding) before the maths: every loss gives a
row without entries loss 0, no gradient and leaves it out of the mean (the contract of
:meth:`BankLoss.rows`), so the drop costs a fill of the (B, K) lists and a count, and adds
nothing to the autograd graph (on a GPU four launches fewer a step than a ``where`` over the
losses and an ``and`` over the counted rows, and none in backward).

In eager mode the batch's lists, the own-index exclusion, the drop and its count are one
call (:meth:`BankLoss._lists_in_one_call`): on CUDA tensors one launch
(``kernels/batch_lists.py``) instead of seven, on CPU tensors one call of the compiled library
(``nnkloss.ops.cpu.batch_lists``, the same contract) instead of two. On CUDA an ``idx``
outside the bank raises IndexError with the checks on (the same host sync) and, with them off,
is dropped and counted like a misaligned row; on CPU tensors it always raises (reading the
counts there is no sync); in a traced CUDA call torch's gather stops the CUDA context with a
device-side assert.
"""
from __future__ import annotations

import abc
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..ops.neighbour_kernel import LossOutput, reduce_rows
from ..validation import (REDUCTIONS, as_index, check_batch, compiling, plain_eager,
                          require_sigma, value_checks_enabled)

__all__ = ["BankLoss", "BankLossStats"]


def _lists_kernel(device: torch.device):
    """The one-call lists of a batch for tensors on ``device`` (``(lists, counts) =
    launch(table, idx, labels, bank_labels, exclude_self)``): on CUDA the launcher of
    ``kernels/batch_lists.py`` (the Triton kernels installed), on the CPU the compiled library's
    :func:`nnkloss.ops.cpu.batch_lists` (None from it leaves the batch to torch's ops); None
    elsewhere."""
    if device.type == "cpu":
        from .. import cpu
        return cpu.batch_lists
    if device.type != "cuda":
        return None
    from ..ops.backends import fused_pass
    kernels = fused_pass(device)
    return None if kernels is None else kernels.batch_lists


def _raise_misaligned(labels: Tensor, idx: Tensor, own: Tensor, mismatched: Tensor) -> None:
    """The value checks' error for a batch whose ``labels`` are not its bank rows' (``own``,
    ``mismatched``: bank labels of idx and where they disagree; reads them)."""
    rows = mismatched.nonzero().flatten()
    i = int(rows[0])
    raise ValueError(
        f"labels disagree with the bank's centre_labels at idx in {rows.numel()} of "
        f"{labels.shape[0]} rows (row {i}: idx[{i}] = {int(idx[i])}, whose centre label "
        f"is {int(own[i])}, but labels[{i}] = {int(labels[i])}): idx must give each "
        "example's own bank row (a loader whose idx is misaligned trains on the wrong "
        "centres)")


class BankLossStats(LossOutput):
    """The :class:`LossOutput` of a bank loss's last call (still the 3-tuple ``(loss, per_row,
    counted)``), plus ``num_mismatched``: the number of rows whose ``labels`` disagreed with
    ``bank.centre_labels[idx]`` and were dropped (0-dim int64 tensor on emb's device; reading it
    syncs on GPU)."""

    def __new__(cls, loss: Tensor, per_row: Tensor, counted: Tensor,
                num_mismatched: Optional[Tensor] = None):
        self = super().__new__(cls, loss, per_row, counted)
        self.num_mismatched = num_mismatched
        return self


class BankLoss(nn.Module, abc.ABC):
    """Base class: ``loss = SomeBankLoss(bank, ...)(emb, labels, idx)``.

    Args:
        bank: the :class:`CentreBank` (a submodule: ``.to()`` and ``state_dict()`` include it).
        reduction: "mean" (over the counted rows), "sum" or "none" ((B,)).
        exclude_self: drop each example's own centre from its list (the papers' rule).

    ``forward(emb, labels, idx)``: emb (B, D) float, labels (B,) int, idx (B,) int bank rows of
    the batch examples; ``labels`` must equal ``bank.centre_labels[idx]`` (checked with value
    checks on; otherwise disagreeing rows are dropped and counted in
    ``last_stats.num_mismatched``).
    Subclasses implement :meth:`rows`.
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
        self.last_stats: Optional[BankLossStats] = None

    def _init_sigma(self, sigma, learn_sigma: bool) -> None:
        """Store ``sigma`` (checked) as the Parameter ``log_sigma`` on the bank's device."""
        sigma = require_sigma(sigma)
        log_sigma = torch.tensor(math.log(sigma), dtype=torch.float32,
                                 device=self.bank.centres.device)
        self.log_sigma = nn.Parameter(log_sigma, requires_grad=bool(learn_sigma))

    def sigma_tensor(self) -> Tensor:
        """Sigma as a 0-dim tensor on the loss's device, differentiable when learned (no host
        read: what the maths uses)."""
        return self.log_sigma.exp()

    def kernel_sigma(self) -> Optional[float]:
        """Sigma as a float (one host read on GPU: for logs and refresh statistics, not the
        training step); None for a loss without a sigma."""
        log_sigma = getattr(self, "log_sigma", None)
        return None if log_sigma is None else float(log_sigma.detach().exp())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A loaded sigma is checked as the constructor checks its argument (require_sigma):
        # exp(log_sigma) positive and finite. An inf log_sigma trained on a constant kernel
        # (sigma inf) without an error; -inf (sigma 0) or NaN only as NaN losses later on.
        key = prefix + "log_sigma"
        value = state_dict.get(key)
        # Integer (and bool) values too: the load casts them into the parameter (an int64
        # log_sigma 100 was loaded unchecked as sigma inf, -200 as sigma 0).
        if (isinstance(getattr(self, "log_sigma", None), nn.Parameter)
                and isinstance(value, Tensor) and value.numel() == 1
                and not value.dtype.is_complex):
            # exp in the parameter's dtype, as sigma_tensor computes it (fp32: inf above 88.7)
            require_sigma(value.detach().to(self.log_sigma.dtype).exp(),
                          name=f"sigma = exp({key})")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def parameter_groups(self) -> Dict[str, List[nn.Parameter]]:
        """The loss's parameters by role, for an optimiser: ``"sigma"`` (``log_sigma``),
        ``"weights"`` (the bank's ``log_weights``) and ``"other"`` (any other parameter of a
        subclass). Every parameter is listed once, trained or not (pick those that require
        grad); a trainer gives sigma and weights their own learning rates and no weight
        decay (decay would pull the logs to 0, i.e. sigma and weights to 1)."""
        sigma = [self.log_sigma] if isinstance(getattr(self, "log_sigma", None),
                                               nn.Parameter) else []
        weights = [self.bank.log_weights]
        known = {id(p) for p in sigma + weights}
        other = [p for p in self.parameters() if id(p) not in known]
        return {"sigma": sigma, "weights": weights, "other": other}

    @abc.abstractmethod
    def rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor) -> Tuple[Tensor, Tensor]:
        """The loss's maths: ``(per_row (B,), counted (B,) bool)`` for embeddings (B, D),
        labels (B,) on emb's device and lists (B, K) into ``self.bank`` (-1 = padding). A row
        whose list is all padding must come out with loss 0, no gradient and not counted
        (forward drops misaligned rows so, whatever their embedding holds)."""

    def forward(self, emb: Tensor, labels: Tensor, idx: Tensor) -> Tensor:
        check_batch(emb, labels, idx)
        idx = as_index(idx)
        labels = as_index(labels).to(emb.device)  # compared with the bank's int32 / int64
        one_call = self._lists_in_one_call(labels, idx)
        if one_call is not None:
            neighbours, num_mismatched = one_call
        else:
            neighbours = self.bank.neighbours_for(idx, self.exclude_self)
            mismatched = self._mismatched(labels, idx)
            if mismatched is None:  # read, and none: nothing to drop
                num_mismatched = torch.zeros((), dtype=torch.int64, device=emb.device)
            else:
                # Misaligned rows lose their lists (see the module docstring); a no-op when
                # there are none.
                mismatched = mismatched.to(neighbours.device)
                neighbours = neighbours.masked_fill(mismatched[:, None], -1)
                num_mismatched = mismatched.sum().to(emb.device)
        per_row, counted = self.rows(emb, labels, neighbours)
        loss = reduce_rows(per_row, counted, self.reduction)
        self.last_stats = BankLossStats(loss.detach(), per_row.detach(), counted, num_mismatched)
        return loss

    def _lists_in_one_call(self, labels: Tensor, idx: Tensor
                           ) -> Optional[Tuple[Tensor, Tensor]]:
        """``(lists, num_mismatched)`` of the batch from one call (:func:`_lists_kernel`: the
        Triton kernel ``kernels/batch_lists.py`` on CUDA tensors, the compiled library on CPU
        tensors; not traced, no dispatch mode); None elsewhere, where
        :meth:`CentreBank.neighbours_for` and :meth:`_mismatched` do the same work (on a GPU in
        seven torch launches, each a few microseconds of host time in a step the host bounds).

        The call gathers the bank rows' lists, excludes each row's own index, empties the
        lists of misaligned rows and counts them. It also empties and counts rows whose idx is
        outside the bank, reading nothing for them. The counts are read with value checks on
        (on a GPU the checks' one host sync) and always on a CPU (no sync there): a misaligned
        batch raises ValueError naming ``idx`` and ``labels`` (checks on), an idx outside the
        bank IndexError naming ``idx`` (on a GPU with the checks on; on a CPU always, as
        :meth:`CentreBank.neighbours_for` raises). On a GPU with them off nothing is read and
        such rows are dropped like misaligned ones (counted in ``num_mismatched``), where
        torch's gather would stop the CUDA context with a device-side assert."""
        bank = self.bank
        table = bank.neighbours
        launch = _lists_kernel(table.device)
        if (launch is None or labels.device != table.device
                or not plain_eager(table, idx, labels, bank.centre_labels)):
            return None
        bank.require_neighbours()
        idx = idx.to(table.device)
        out = launch(table, idx, labels, bank.centre_labels, self.exclude_self)
        if out is None:  # the CPU library unavailable, or tensors it does not take
            return None
        lists, counts = out
        checks = value_checks_enabled()
        # The CPU library's counts are host memory: read always (no sync); the GPU's with the
        # checks on (their one host sync).
        if checks or getattr(launch, "host_counts", False):
            dropped, outside = counts.tolist()
            if outside:
                bank.check_rows(idx)
            if dropped and checks:
                own = bank.centre_labels[idx]
                _raise_misaligned(labels, idx, own, own != labels)
        return lists, counts[0]

    def _mismatched(self, labels: Tensor, idx: Tensor) -> Optional[Tensor]:
        """(B,) bool on labels' device: rows whose label is not their bank row's; None when it
        was read and no row disagrees (forward then fills no lists). Raises with value checks
        on (one host sync on GPU; idx is in range: neighbours_for checked it on the CPU, and a
        CUDA gather with a bad index fails by itself). Read with the checks on, not while
        compiling; with them off nothing is read. The route of calls the one-call lists do not
        take (:meth:`_lists_in_one_call`: traced, a dispatch mode, emb and bank on different
        devices, the CPU library unavailable)."""
        bank_labels = self.bank.centre_labels
        checks = value_checks_enabled() and not compiling()
        own = bank_labels[idx.to(bank_labels.device)].to(labels.device)
        mismatched = own != labels
        if not checks:
            return mismatched
        if not bool(mismatched.any()):
            return None
        _raise_misaligned(labels, idx, own, mismatched)

    @property
    def last_num_mismatched(self) -> Optional[Tensor]:
        """Rows dropped in the last call because their labels disagreed with the bank's centre
        labels (0-dim tensor, no sync), None before the first call."""
        return None if self.last_stats is None else self.last_stats.num_mismatched

    @property
    def last_num_counted(self) -> Optional[Tensor]:
        """Rows counted in the last call's mean (0-dim tensor), None before the first call."""
        return None if self.last_stats is None else self.last_stats.num_counted

    def log_values(self) -> Dict[str, float]:
        """Scalars for a training log (read once per epoch: may sync); ``sigma`` for a loss
        with one."""
        sigma = self.kernel_sigma()
        return {} if sigma is None else {"sigma": sigma}
