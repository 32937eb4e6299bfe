"""The contract of a loss over a :class:`CentreBank` (the template every bank loss follows).

Like pytorch-metric-learning's base loss, the template does what every such loss needs -- the
argument checks, each row's neighbour list (its own centre excluded), the reduction and the
statistics of the last call -- so that a loss is only its maths: :meth:`BankLoss.rows`.

A training loop may rely on (``nnkloss.experiment.Trainer`` does): ``bank`` (to refresh),
``last_stats``, ``last_num_counted`` and ``last_num_mismatched`` (0-dim tensors: no sync),
:meth:`kernel_sigma`, :meth:`log_values` and :meth:`parameter_groups`.

Sigma, in every loss that has one, is the Parameter ``log_sigma`` (0-dim fp32; it requires
grad only when learned, and exp keeps it positive): a float from :meth:`kernel_sigma` (one
host read), a 0-dim tensor from :meth:`sigma_tensor` (differentiable, no host read).

Misaligned batches: ``idx`` must give each example's own bank row, so ``labels`` must equal
``bank.centre_labels[idx]``. With value checks on (the default) a disagreement raises, naming
``idx`` and ``labels`` (one host sync on GPU). With them off, or under ``torch.compile``, such
rows are **dropped** -- their lists emptied, so loss 0, no gradient, out of the mean -- and
counted in ``last_stats.num_mismatched`` without a sync: their lists and own-centre exclusion
belong to another example, so their loss would train on the wrong centres.

In eager mode the lists, the exclusion, the drop and its count are one backend call
(``batch_lists``). An ``idx`` outside the bank raises IndexError on CPU tensors, and on CUDA
with the checks on; on CUDA with them off it is dropped and counted like a misaligned row.
"""
from __future__ import annotations

import abc
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..ops.backends import backend
from ..ops.neighbour_kernel import LossOutput, reduce_rows
from ..validation import (REDUCTIONS, check_batch, compiling, plain_eager, require_sigma,
                          value_checks_enabled)

__all__ = ["BankLoss", "BankLossStats"]


def _lists_kernel(device: torch.device, choice: str = "auto"):
    """The one-call lists of a batch for tensors on ``device`` from the backend ``choice``
    resolves to (``(lists, counts) = launch(table, idx, labels, bank_labels, exclude_self)``,
    None from it leaves the batch to torch's ops), or None where it has none."""
    return backend(choice, device, torch.int64).batch_lists


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
        self._mismatched = num_mismatched  # or a batch_lists' counts: read on demand
        return self

    @property
    def num_mismatched(self) -> Optional[Tensor]:
        m = self._mismatched
        if type(m) is tuple:  # the CPU library's host ints
            m = self._mismatched = torch.tensor(m[0])
        return m if m is None or m.dim() == 0 else m[0]


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
        self.last_stats = None

    def _init_sigma(self, sigma, learn_sigma: bool) -> None:
        """Store ``sigma`` (checked) as the Parameter ``log_sigma`` on the bank's device."""
        sigma = require_sigma(sigma)
        log_sigma = torch.tensor(math.log(sigma), dtype=torch.float32,
                                 device=self.bank.centres.device)
        self.log_sigma = nn.Parameter(log_sigma, requires_grad=bool(learn_sigma))

    def sigma_tensor(self) -> Tensor:
        """Sigma as a 0-dim tensor on the loss's device, differentiable when learned (no host
        read: what the maths uses). A fixed sigma is computed once per value of
        ``log_sigma`` (its version counter and storage), not once per call."""
        log_sigma = self._parameters["log_sigma"]
        if (log_sigma.requires_grad and torch.is_grad_enabled()) or compiling():
            return log_sigma.exp()
        key = (log_sigma._version, log_sigma.data_ptr(), log_sigma.device)
        cached = self.__dict__.get("_fixed_sigma")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_fixed_sigma"] = (key, log_sigma.detach().exp())
        return cached[1]

    def kernel_sigma(self) -> Optional[float]:
        """Sigma as a float (one host read on GPU: for logs and refresh statistics, not the
        training step); None for a loss without a sigma."""
        log_sigma = getattr(self, "log_sigma", None)
        return None if log_sigma is None else float(log_sigma.detach().exp())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A loaded sigma is checked as the constructor's (require_sigma): an inf log_sigma
        # would train a constant kernel silently, -inf or NaN give NaN losses later on.
        # Integer values too: the load casts them into the parameter.
        key = prefix + "log_sigma"
        value = state_dict.get(key)
        if (isinstance(getattr(self, "log_sigma", None), nn.Parameter)
                and isinstance(value, Tensor) and value.numel() == 1
                and not value.dtype.is_complex):
            # exp in the parameter's dtype, as sigma_tensor computes it (fp32: inf above 88.7)
            require_sigma(value.detach().to(self.log_sigma.dtype).exp(),
                          name=f"sigma = exp({key})")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def parameter_groups(self) -> Dict[str, List[nn.Parameter]]:
        """The loss's parameters by role: ``"sigma"`` (``log_sigma``), ``"weights"`` (the
        bank's ``log_weights``) and ``"other"``, each listed once, trained or not. A trainer
        gives sigma and weights their own learning rates and no weight decay (which would pull
        them to 1)."""
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

    def loss_rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor
                  ) -> Tuple[Tensor, Tensor, Tensor]:
        """``(loss, per_row, counted)``: :meth:`rows` and the reduction; a loss whose op
        reduces in the same call overrides this."""
        per_row, counted = self.rows(emb, labels, neighbours)
        return reduce_rows(per_row, counted, self.reduction), per_row, counted

    def forward(self, emb: Tensor, labels: Tensor, idx: Tensor) -> Tensor:
        bank = self._modules["bank"]  # no nn.Module lookup: a step's cost
        centres, centre_labels, table = bank.loss_tensors()
        labels, idx = check_batch(emb, labels, idx, centres)
        lists = self._lists_in_one_call(bank, table, centre_labels, labels, idx)
        if lists is not None:
            neighbours, num_mismatched = lists  # the counts: the first is the stats' number
        else:
            neighbours = bank.neighbours_for(idx, self.exclude_self)
            mismatched = self._mismatched(labels, idx)
            if mismatched is None:  # read, and none: nothing to drop
                num_mismatched = torch.zeros((), dtype=torch.int64, device=emb.device)
            else:
                # misaligned rows lose their lists (see the module docstring)
                mismatched = mismatched.to(neighbours.device)
                neighbours = neighbours.masked_fill(mismatched[:, None], -1)
                num_mismatched = mismatched.sum().to(emb.device)
        loss, per_row, counted = self.loss_rows(emb, labels, neighbours)
        # :attr:`last_stats` is built from these when read
        self.__dict__["_last"] = (loss.detach(), per_row.detach(), counted, num_mismatched)
        return loss

    @property
    def last_stats(self) -> Optional[BankLossStats]:
        """The :class:`BankLossStats` of the last call, None before the first."""
        last = self.__dict__.get("_last")
        if type(last) is tuple:
            last = self.__dict__["_last"] = BankLossStats(*last)
        return last

    @last_stats.setter
    def last_stats(self, stats: Optional[BankLossStats]) -> None:
        self.__dict__["_last"] = stats

    def _lists_in_one_call(self, bank: CentreBank, table: Tensor, centre_labels: Tensor,
                           labels: Tensor, idx: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """``(lists, counts)`` of the batch from the backend's one call (eager only); None
        where :meth:`CentreBank.neighbours_for` and :meth:`_mismatched` do it in torch's ops.
        The counts (rows dropped, rows outside the bank) are read with value checks on (a
        GPU's one host sync) and always on a CPU (no sync): a misaligned batch raises
        ValueError naming ``idx`` and ``labels``, an idx outside the bank IndexError naming
        ``idx``. On a GPU with the checks off such rows are dropped, where torch's gather
        would stop the CUDA context with a device-side assert."""
        device = table.device
        choice = getattr(self, "backend", "auto")  # the loss's op's, so one route on a device
        launch = _lists_kernel(device, "auto" if choice == "torch" else choice)
        # labels are on the bank's device (check_batch)
        if launch is None or not plain_eager(table, idx, labels):
            return None
        if not table.shape[1]:
            bank.require_neighbours()
        if idx.device != device:
            idx = idx.to(device)
        out = launch(table, idx, labels, centre_labels, self.exclude_self)
        if out is None:  # tensors it does not take
            return None
        lists, counts = out
        checks = value_checks_enabled()
        # The CPU library's counts are host ints: read always (no sync); the GPU's tensor with
        # the checks on (its one host sync).
        host = type(counts) is tuple
        if checks or host:
            dropped, outside = counts if host else counts.tolist()
            if outside:
                bank.check_rows(idx)
            if dropped and checks:
                own = centre_labels[idx]
                _raise_misaligned(labels, idx, own, own != labels)
        return lists, counts

    def _mismatched(self, labels: Tensor, idx: Tensor) -> Optional[Tensor]:
        """(B,) bool on labels' device: rows whose label is not their bank row's; None when
        read and none disagrees. Raises with value checks on (one host sync on GPU); reads
        nothing with them off or while compiling. The route of calls the one-call lists do
        not take (traced, a dispatch mode, emb and bank on different devices, no library)."""
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
