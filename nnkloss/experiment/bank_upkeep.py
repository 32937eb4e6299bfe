"""The Trainer's bank maintenance: :class:`BankUpkeep` drives a Refresher for the loop.

Its log columns per epoch: ``start_refresh_*`` (before the first step), ``refresh_*`` (the
last during the steps), ``end_refresh_*`` (after the last) and ``neighbours_*`` (the list
rebuilds).
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from .. import distributed as _dist
from ..bank import exchange
from ..bank.refresh import RefreshSchedule
from ..losses.base import BankLoss
from ..validation import require_positive_int
from .logs import json_safe

__all__ = ["BankUpkeep", "write_fresh_centres"]


def _check_options(criterion, refresher, fresh_centres, neighbours_every_steps,
                   warm_start_steps) -> Tuple[Optional[float], Optional[int], int]:
    if fresh_centres is not None:
        if isinstance(fresh_centres, bool) or not isinstance(fresh_centres, numbers.Real):
            raise TypeError(f"fresh_centres must be None or a momentum in [0, 1), got "
                            f"{type(fresh_centres).__name__}")
        fresh_centres = float(fresh_centres)
        if not 0.0 <= fresh_centres < 1.0:
            raise ValueError(f"fresh_centres must be None or a momentum in [0, 1), got "
                             f"{fresh_centres}")
    if neighbours_every_steps is not None:
        neighbours_every_steps = require_positive_int("neighbours_every_steps",
                                                      neighbours_every_steps)
    if (isinstance(warm_start_steps, bool) or not isinstance(warm_start_steps, numbers.Integral)
            or warm_start_steps < 0):
        raise ValueError(f"warm_start_steps must be an int >= 0, got {warm_start_steps!r}")
    wanted = [name for name, on in (("fresh_centres", fresh_centres is not None),
                                    ("neighbours_every_steps", neighbours_every_steps is not None),
                                    ("warm_start_steps", warm_start_steps > 0)) if on]
    if wanted and not isinstance(criterion, BankLoss):
        raise ValueError(f"{', '.join(wanted)} need a criterion with a bank (a "
                         f"nnkloss.losses.BankLoss), got {type(criterion).__name__}")
    if neighbours_every_steps is not None and not callable(getattr(refresher,
                                                                   "rebuild_neighbours", None)):
        raise TypeError("neighbours_every_steps needs a refresher with rebuild_neighbours() "
                        "(nnkloss.Refresher)")
    return fresh_centres, neighbours_every_steps, int(warm_start_steps)


@torch.no_grad()
def write_fresh_centres(bank, idx: Tensor, emb: Tensor, momentum: float) -> None:
    """``bank.write_centres_`` with this step's rows (every rank's, under torch.distributed)."""
    idx = idx.to(bank.centres.device)
    emb = emb.to(bank.centres.device)
    if _dist.is_distributed():
        idx, emb = exchange.gather_batch_rows(idx, emb)
    bank.write_centres_(idx, emb, momentum)


def refresh_columns(stats, prefix: str = "refresh_") -> Dict[str, Any]:
    """The numeric fields of a refresh's stats (a dict or a dataclass, or None) as log
    columns ``prefix<field>``."""
    if stats is None:
        return {}
    fields = stats if isinstance(stats, dict) else vars(stats)
    fields = {k: json_safe(v) for k, v in fields.items()}
    return {f"{prefix}{k}": v for k, v in fields.items() if isinstance(v, (int, float, bool))}


class BankUpkeep:
    """The bank maintenance of one training run: the initial bank, the scheduled refreshes,
    the Trainer's ``fresh_centres``, ``neighbours_every_steps`` and ``warm_start_steps``, and the
    checkpointed ``bank_ready`` and ``refresh_due``.

    ``criterion`` gives the sigma and the bank; ``refresher`` (or None) embeds with ``model``.
    The loop calls :meth:`before_fit`, then per epoch :meth:`start_epoch`, :meth:`after_step`
    per step, :meth:`epoch_columns`, :meth:`end_epoch`; :meth:`finish_async` before a checkpoint.
    """

    def __init__(self, criterion: nn.Module, model: nn.Module, refresher, schedule,
                 fresh_centres=None, neighbours_every_steps=None, warm_start_steps=0):
        if schedule is None:
            schedule = RefreshSchedule(every_epochs=10)  # the papers' update interval
        elif not isinstance(schedule, RefreshSchedule):
            raise TypeError(f"schedule must be a nnkloss.RefreshSchedule, got "
                            f"{type(schedule).__name__}")
        self.fresh_centres, self.neighbours_every_steps, self.warm_start_steps = _check_options(
            criterion, refresher, fresh_centres, neighbours_every_steps, warm_start_steps)
        self.criterion = criterion
        self.model = model
        self.refresher = refresher
        self.schedule = schedule
        self.bank_ready = False
        #: a fit()'s last epoch skipped its refresh; a continuing fit() does it first.
        self.refresh_due = False
        self._pending: Dict[str, Any] = {}   # log of a refresh before the epoch's first step
        self._refreshes: Dict[str, Any] = {}  # the epoch's last refresh columns
        self._lists: Dict[str, Any] = {}      # the epoch's list-rebuild statistics

    @property
    def is_async(self) -> bool:
        """The refresher runs in the background (False without one)."""
        return bool(getattr(self.refresher, "async_mode", False))

    def refresh(self, wait: bool = True) -> Dict[str, Any]:
        """Re-embed the training set and rebuild the lists; returns the ``refresh_*`` columns.
        With an asynchronous refresher and ``wait=False`` it only starts one (returns {})."""
        sigma = self.criterion.kernel_sigma()
        if self.is_async and not wait:
            if not self.refresher.in_flight:
                self.refresher.refresh_async(sigma)
            return {}
        t0 = time.perf_counter()  # the Refresher restores the model's modes itself
        if self.is_async and self.refresher.in_flight:
            self.refresher.wait()  # finish the one in flight first, then a fresh one
        out = refresh_columns(self.refresher.refresh(sigma))
        self.bank_ready = True
        return {**out, "refresh_time_s": time.perf_counter() - t0}

    def finish_async(self) -> Dict[str, Any]:
        """Swap in a background refresh still in flight (before checkpoints and at the end)."""
        if self.is_async and self.refresher.in_flight:
            return refresh_columns(self.refresher.wait(), "end_refresh_")
        return {}

    @property
    def needs_initial_bank(self) -> bool:
        """The next :meth:`before_fit` builds the initial bank."""
        return self.refresher is not None and not self.bank_ready

    def before_fit(self, more_epochs: bool) -> None:
        """Before a fit's first step: the initial bank, or the skipped refresh if this fit
        trains ``more_epochs``; logged by :meth:`take_pending`."""
        if self.needs_initial_bank or (self.refresher is not None and self.refresh_due
                                       and more_epochs):
            self._pending = self.refresh()
        if more_epochs:
            self.refresh_due = False

    def take_pending(self) -> Dict[str, Any]:
        """The log of a refresh before the epoch's first step, once, as ``start_refresh_*``."""
        out, self._pending = self._pending, {}
        return {f"start_{k}": v for k, v in out.items()}

    def start_epoch(self) -> None:
        self._refreshes = {}
        self._lists = {}

    def after_step(self, step: int, idx: Tensor, emb: Tensor) -> None:
        """After step ``step`` (rows ``idx``, embeddings ``emb``): fresh centres, a finished
        background refresh, list rebuilds and due refreshes."""
        if self.fresh_centres is not None:
            write_fresh_centres(self.criterion.bank, idx, emb.detach(), self.fresh_centres)
        if self.is_async and self.refresher.in_flight:
            done = self.refresher.poll()  # a thread liveness check: no sync
            if done is not None:
                self._refreshes = refresh_columns(done)
        due = self.schedule.step() or step == self.warm_start_steps
        due = due and self.refresher is not None
        if (self.neighbours_every_steps is not None and step % self.neighbours_every_steps == 0
                and not (due and not self.is_async)):  # a synchronous refresh does it now
            self._rebuild_neighbours()
        if due:
            self._refreshes = self.refresh(wait=False) or self._refreshes
            self.model.train()

    def _rebuild_neighbours(self) -> None:
        """Rebuild the lists from the current centres, accumulating the epoch's statistics."""
        log = self._lists
        t0 = time.perf_counter()
        stats = self.refresher.rebuild_neighbours(self.criterion.kernel_sigma())
        log["rebuilds"] = log.get("rebuilds", 0) + 1
        log["time_s"] = log.get("time_s", 0.0) + time.perf_counter() - t0
        if stats.overlap is not None:
            log.setdefault("overlaps", []).append(stats.overlap)
        log["positive_share"] = stats.positive_share
        log["mean_kernel"] = stats.mean_kernel

    def epoch_columns(self) -> Dict[str, Any]:
        """The epoch's refresh and ``neighbours_*`` log columns (after its last step)."""
        row = dict(self._refreshes)
        log = self._lists
        if log:
            row.update(neighbours_rebuilds=log["rebuilds"], neighbours_time_s=log["time_s"],
                       neighbours_positive_share=log["positive_share"])
            if log.get("overlaps"):
                row["neighbours_overlap"] = float(np.mean(log["overlaps"]))
            if log.get("mean_kernel") is not None:
                row["neighbours_mean_kernel"] = log["mean_kernel"]
        return row

    def end_epoch(self, last: bool) -> Dict[str, Any]:
        """After an epoch: the scheduled refresh (after the ``last``, left due); its columns."""
        due = self.schedule.epoch_end() and self.refresher is not None
        out = self.refresh(wait=False) if due and not last else {}
        self.refresh_due = due and last
        return {f"end_{k}": v for k, v in out.items()}
