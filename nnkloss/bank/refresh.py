"""Periodic centre refresh; centres stay fixed between refreshes (Meyer et al. 2018, Sec. 2.3).
:class:`Refresher` does one, synchronously or in a background thread; :class:`RefreshSchedule`
says when."""
from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from .centre_bank import CentreBank
from ..validation import all_finite, as_index, require_int, require_positive_int, require_sigma
from .search import NeighbourLists, knn, neighbour_lists, synchronize
from .search.knn import check_search_arguments
from .. import distributed as _dist
from ..inference import inference_model, to_device
from . import exchange

__all__ = ["Refresher", "RefreshSchedule", "RefreshStats", "recalibrate_batch_norms"]


@dataclass
class RefreshStats:
    """What one refresh did (paper Fig. 4b/4c).

    embed_seconds, search_seconds, recalibrate_seconds: wall times of the passes.
    mean_sq_distance, mean_kernel: means over the listed pairs of d and of
    exp(-d / (2 sigma^2)) (None without ``sigma``).
    positive_share: share of rows whose list holds a centre of their own label.
    num_patched: rows given a same-label entry by ``ensure_positive``.
    overlap: mean share of each new list the old list also held (None without old lists).
    """
    embed_seconds: float
    search_seconds: float
    num_rows: int
    k: int
    mean_sq_distance: float
    mean_kernel: Optional[float]
    sigma: Optional[float]
    positive_share: float
    num_patched: int
    overlap: Optional[float]
    search_backend: str
    asynchronous: bool = False
    recalibrate_seconds: float = 0.0


def _list_overlap(new: Tensor, old: Tensor) -> float:
    """Mean per-row share of the new list's entries (-1 padding excluded) the old list holds."""
    from .. import cpu
    old = old.to(new.device)
    both = cpu.list_overlap(new, old, new.shape[0])
    if both is not None:
        counts, valid = both
    else:
        old_sorted = old.sort(dim=1).values.contiguous()
        pos = torch.searchsorted(old_sorted, new.contiguous()).clamp_max(old_sorted.shape[1] - 1)
        counts = ((old_sorted.gather(1, pos) == new) & (new >= 0)).sum(1)
        valid = (new >= 0).sum(1)
    return float((counts.float() / valid.clamp_min(1)).mean())


# Elements per step of the statistics on CPU tensors, so that its passes stay in the cache.
STATS_ELEMS = 1 << 18


def _distance_means(d: Tensor, sigma) -> Tuple[float, Optional[float]]:
    """Means of the finite distances and (with sigma) of their kernel values, in fp64."""
    rows = d.shape[0]
    step = max(1, STATS_ELEMS // max(1, d.shape[1])) if d.is_cpu else max(1, rows)
    acc = torch.zeros(3, dtype=torch.float64, device=d.device)  # count, sum d, sum kernel
    for r0 in range(0, rows, step):
        x = d[r0:r0 + step]
        finite = torch.isfinite(x)
        x0 = x.masked_fill(~finite, 0.0)
        acc[0] += finite.sum()
        acc[1] += x0.sum(dtype=torch.float64)
        if sigma is not None:
            kern = torch.exp(x0 * (-0.5 / (sigma * sigma))).masked_fill_(~finite, 0.0)
            acc[2] += kern.sum(dtype=torch.float64)
    n, sum_d, sum_k = acc.tolist()
    n = max(n, 1.0)
    return sum_d / n, (None if sigma is None else sum_k / n)


def _check_sigma(sigma) -> Optional[float]:
    return None if sigma is None else require_sigma(sigma)


def _sigma_source(sigma):
    """What ``Refresher(sigma=...)`` keeps: None, a float, or a source read at every refresh
    (a loss's ``kernel_sigma``, a callable, a 0-dim tensor checked now)."""
    if hasattr(sigma, "kernel_sigma") and callable(sigma.kernel_sigma):
        return sigma.kernel_sigma
    if callable(sigma):
        return sigma
    checked = _check_sigma(sigma)  # bad values fail now, not at the first refresh
    return sigma if isinstance(sigma, Tensor) else checked


class RefreshSchedule:
    """When to refresh: every ``every_epochs`` completed epochs and/or ``every_steps`` steps
    (:meth:`step` and :meth:`epoch_end` count them). No host sync."""

    def __init__(self, every_epochs: Optional[int] = None, every_steps: Optional[int] = None):
        self.every_epochs, self.every_steps = (
            None if v is None else require_positive_int(name, v)
            for name, v in (("every_epochs", every_epochs), ("every_steps", every_steps)))
        if every_epochs is None and every_steps is None:
            raise ValueError("give every_epochs and/or every_steps (a schedule that never fires "
                             "would leave the centres stale forever)")
        self.epoch = 0  # epochs completed (counted by epoch_end)
        self.global_step = 0  # steps completed (counted by step)

    def should_refresh(self, epoch: Optional[int] = None, step: Optional[int] = None) -> bool:
        """True when ``epoch`` or ``step`` (those completed) hits its interval."""
        return any(count is not None and every is not None and count > 0 and count % every == 0
                   for count, every in ((epoch, self.every_epochs), (step, self.every_steps)))

    def step(self) -> bool:
        """Count one completed optimiser step; True if a step-based refresh is due now."""
        self.global_step += 1
        return self.should_refresh(step=self.global_step)

    def epoch_end(self) -> bool:
        """Count one completed epoch; True if an epoch-based refresh is due now."""
        self.epoch += 1
        return self.should_refresh(epoch=self.epoch)

    def state_dict(self) -> dict:
        return {"every_epochs": self.every_epochs, "every_steps": self.every_steps,
                "epoch": self.epoch, "global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])

    def __repr__(self) -> str:
        return (f"RefreshSchedule(every_epochs={self.every_epochs}, every_steps={self.every_steps}"
                f", epoch={self.epoch}, global_step={self.global_step})")


def recalibrate_batch_norms(model: nn.Module, loader: Iterable, device: torch.device,
                           batches: Optional[int] = None) -> int:
    """Set the running statistics of ``model``'s training-mode BatchNorms to the average of
    their batch statistics over ``loader`` (its first ``batches``), so that eval mode
    normalises as training does; returns how many were set."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
           and m.training and m.track_running_stats and m.running_mean is not None]
    if not bns:
        return 0
    momenta = [m.momentum for m in bns]
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        with torch.no_grad():
            for batch in itertools.islice(loader, batches):
                model(to_device(batch[0] if isinstance(batch, (tuple, list)) else batch, device))
    finally:
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
    return len(bns)


# knn's options that neighbour_lists does not set itself.
_KNN_OPTIONS = frozenset(inspect.signature(knn).parameters) - {
    "queries", "base", "k", "search_backend", "exclude_self"}


class Refresher:
    """Re-embeds the whole training set and rebuilds the bank's neighbour lists.

    Args:
        bank: the :class:`CentreBank` to refresh; one row per training example.
        model: the embedding network, ``model(inputs) -> (B, D)``.
        loader: yields ``(inputs, labels, idx)``, idx the bank rows; every row at least once
            (a repeat keeps its last embedding). Use one without augmentation.
        k: neighbour-list length (<= N - 1).
        search_backend, knn_options: as in :func:`nnkloss.knn`, checked here.
        ensure_positive: see :func:`nnkloss.bank.search.neighbour_lists`.
        device: where the model runs (default: its parameters', else the bank's). Embeddings
            are stored on the bank's device in its dtype.
        progress: a tqdm bar while embedding.
        async_mode: :meth:`request` starts :meth:`refresh_async`; the snapshot is made now.
        sigma: kernel width of the ``mean_kernel`` statistic (a call's ``sigma`` wins): a
            float, or read at every refresh from a loss (``kernel_sigma()``), a zero-argument
            callable or a 0-dim tensor.
        recalibrate_bn: first :func:`recalibrate_batch_norms` over the whole loader (True), its
            first that many batches (int), or not (False).

    :meth:`refresh` embeds in eval mode into a new (N, D) tensor and swaps centres, labels and
    lists in at once: a failed refresh leaves the bank untouched. :meth:`refresh_async` does it
    in a background thread on a snapshot of the weights, until :meth:`poll` or :meth:`wait`.
    """

    def __init__(self, bank: CentreBank, model: nn.Module, loader: Iterable, k: int,
                 search_backend: str = "auto", ensure_positive: bool = False,
                 device: Optional[torch.device] = None, progress: bool = False,
                 async_mode: bool = False, sigma=None, knn_options: Optional[dict] = None,
                 recalibrate_bn=True):
        if not isinstance(bank, CentreBank):
            raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        k = require_positive_int("k", k)
        if k > bank.num_centres - 1:
            raise ValueError(f"k={k} is larger than the number of other centres "
                             f"({bank.num_centres - 1}) in the bank")
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"loader must be an iterable of (inputs, labels, idx), got "
                            f"{type(loader).__name__}")
        self.bank = bank
        self.model = model
        self.loader = loader
        self.k = int(k)
        self.search_backend = search_backend
        self.ensure_positive = bool(ensure_positive)
        self.device = torch.device(device) if device is not None else None
        self.progress = bool(progress)
        self.async_mode = bool(async_mode)
        self._sigma_source = _sigma_source(sigma)
        self.knn_options = dict(knn_options or {})
        self.recalibrate_bn = (recalibrate_bn if isinstance(recalibrate_bn, bool)
                               else require_positive_int("recalibrate_bn", recalibrate_bn))
        # Search options are checked now, not after the first embedding pass.
        unknown = set(self.knn_options) - _KNN_OPTIONS
        if unknown:
            raise TypeError(f"knn_options got unknown options {sorted(unknown)}; accepted: "
                            f"{sorted(_KNN_OPTIONS)}")
        check_search_arguments(search_backend, self.knn_options.get("approximate"),
                               self.knn_options, "knn_options[{!r}]")
        self.last_stats: Optional[RefreshStats] = None
        self._snapshot = self._make_snapshot() if self.async_mode else None
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[tuple] = None  # a refresh computed but not yet swapped in
        self._error: Optional[BaseException] = None

    @property
    def in_flight(self) -> bool:
        """A background refresh has been started and not yet swapped in (or failed)."""
        return self._thread is not None

    def request(self, sigma=None) -> Optional[RefreshStats]:
        """Refresh the configured way: synchronously (returns stats) or, with
        ``async_mode=True``, start a background refresh (returns None; see :meth:`poll`)."""
        if self.async_mode:
            self.refresh_async(sigma)
            return None
        return self.refresh(sigma)

    def refresh(self, sigma=None) -> RefreshStats:
        """Embed the set, rebuild the lists and swap them into the bank; return the stats."""
        if self.in_flight:
            raise RuntimeError("a background refresh is in flight: call wait() (or poll()) first")
        sig = self._sigma(sigma)
        return self._swap(*self._compute(self.model, self._device(), sig, None, False))

    def rebuild_neighbours(self, sigma=None) -> RefreshStats:
        """Rebuild the lists from the bank's current centres, without re-embedding
        (``embed_seconds`` 0); a refresh in flight is left alone. Under torch.distributed
        every rank calls it at the same point, with identical banks."""
        lists, stats = self._build_lists(self.bank.centres, self.bank.centre_labels, 0.0,
                                         self._sigma(sigma), False)
        self.bank.update_(neighbours=lists.neighbours)
        return stats

    def refresh_async(self, sigma=None) -> None:
        """Start computing the next bank in a background thread (snapshot of the weights now)."""
        if self.in_flight:
            raise RuntimeError("a background refresh is already in flight: poll()/wait() first")
        exchange.check_async_refresh()
        sig = self._sigma(sigma)
        placed = {k: (t.device, t.dtype) for k, t in self.model.state_dict().items()}
        snap = self._snapshot
        if snap is None or placed != {k: (t.device, t.dtype) for k, t in snap.state_dict().items()}:
            snap = self._snapshot = self._make_snapshot()  # the model was moved or cast since
        device = self._device()
        # On the training stream: after the queued steps, before any later update.
        with torch.no_grad():
            snap.load_state_dict(self.model.state_dict())
        for s_mod, m in zip(snap.modules(), self.model.modules()):  # which BatchNorms train
            s_mod.training = m.training
        stream = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._worker, args=(snap, device, sig, stream),
                                        name="nnkloss-refresh", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[RefreshStats]:
        """Swap in a finished background refresh and return its stats; None if not finished
        (or none started). Re-raises the background error, leaving the bank untouched."""
        return self.wait(0)

    def wait(self, timeout: Optional[float] = None) -> Optional[RefreshStats]:
        """Block until the background refresh finishes, swap it in and return its stats.
        None if none was started, or if ``timeout`` seconds passed first."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._finish()

    @property
    def sigma(self) -> Optional[float]:
        """The statistics' default sigma, read now from what ``sigma=`` was."""
        source = self._sigma_source
        return _check_sigma(source() if callable(source) else source)

    def _sigma(self, sigma) -> Optional[float]:
        return self.sigma if sigma is None else _check_sigma(sigma)

    def _device(self) -> torch.device:
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        return self.device or (self.bank.centres.device if first is None else first.device)

    def _make_snapshot(self) -> nn.Module:
        snap = copy.deepcopy(self.model)
        snap.eval()
        for p in snap.parameters():
            p.requires_grad_(False)
        return snap

    def _worker(self, snap, device, sigma, stream) -> None:
        try:
            self._result = self._compute(snap, device, sigma, stream, asynchronous=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread in poll()
            self._error = exc

    def _finish(self) -> RefreshStats:
        self._thread.join()
        self._thread = None
        error, result = self._error, self._result
        self._error = self._result = None
        if error is not None:
            raise RuntimeError("background refresh failed; the bank was left unchanged") from error
        return self._swap(*result)

    def _compute(self, model: nn.Module, device: torch.device, sigma, stream,
                 asynchronous: bool) -> tuple:
        n, d = self.bank.num_centres, self.bank.dim
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            t0, recalibrate_s = time.perf_counter(), 0.0
            if self.recalibrate_bn and recalibrate_batch_norms(
                    model, self.loader, device,
                    None if self.recalibrate_bn is True else self.recalibrate_bn):
                recalibrate_s = time.perf_counter() - t0
            if _dist.is_distributed():  # every rank embeds with rank 0's buffers
                _dist.broadcast_buffers(model)
            t0 = time.perf_counter()
            centres, centre_labels = self._embed(model, device, n, d)
            synchronize(centres.device)  # this thread's stream only, not training's
            embed_s = time.perf_counter() - t0
            lists, stats = self._build_lists(centres, centre_labels, embed_s, sigma, asynchronous,
                                             recalibrate_s)
        return centres, centre_labels, lists.neighbours, stats, stream

    def _build_lists(self, centres: Tensor, centre_labels: Tensor, embed_s: float, sigma,
                     asynchronous: bool, recalibrate_s=0.0) -> Tuple[NeighbourLists, RefreshStats]:
        """The lists of ``centres`` with this refresher's options, and their stats."""
        search = exchange.neighbour_lists if _dist.is_distributed() else neighbour_lists
        lists = search(centres, centre_labels, self.k, search_backend=self.search_backend,
                       ensure_positive=self.ensure_positive, **self.knn_options)
        d, old = lists.distances, self.bank.neighbours
        mean_d, mean_kernel = _distance_means(d, sigma)
        overlap = (_list_overlap(lists.neighbours, old)
                   if old.shape[0] == d.shape[0] and old.shape[1] > 0 else None)
        return lists, RefreshStats(
            embed_s, lists.seconds, d.shape[0], d.shape[1], mean_d, mean_kernel, sigma,
            float(lists.has_positive.float().mean()), lists.num_patched, overlap,
            lists.search_backend, asynchronous, recalibrate_s)

    def _embed(self, model: nn.Module, device: torch.device, n: int, d: int):
        dev, dtype = self.bank.centres.device, self.bank.centres.dtype
        centres = torch.empty(n, d, dtype=dtype, device=dev)
        centre_labels = torch.empty(n, dtype=torch.long, device=dev)
        written = torch.zeros(n, dtype=torch.bool, device=dev)
        out_of_range = torch.zeros((), dtype=torch.bool, device=dev)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            net = inference_model(model)  # BatchNorms folded (nnkloss.inference)
            with torch.no_grad():
                for batch in self._progress(self.loader):
                    if not isinstance(batch, (tuple, list)) or len(batch) != 3:
                        raise ValueError("loader must yield (inputs, labels, idx) triples")
                    inputs, y, idx = batch
                    require_int("idx", idx, 1)
                    idx = as_index(idx)
                    require_int("labels", y, 1)
                    if y.shape[0] != idx.shape[0]:
                        # centre_labels[idx] = y below would broadcast one label over the batch
                        raise ValueError(f"loader yielded {y.shape[0]} labels for "
                                         f"{idx.shape[0]} idx: one label per bank row")
                    if idx.device.type != "cpu":  # no per-batch sync: flag now, raise later
                        idx = idx.to(dev)
                        out_of_range |= ((idx < 0) | (idx >= n)).any()
                        idx = idx.clamp(0, n - 1)
                    elif idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                        raise IndexError(f"loader yielded idx outside the bank's rows 0..{n - 1}"
                                         f" (min {int(idx.min())}, max {int(idx.max())})")
                    emb = net(to_device(inputs, device))
                    if not isinstance(emb, Tensor) or emb.shape != (idx.shape[0], d):
                        shape = tuple(emb.shape) if isinstance(emb, Tensor) else type(emb)
                        raise ValueError(f"model output has shape {shape}; expected "
                                         f"({idx.shape[0]}, {d}) for this batch and bank")
                    idx = idx.to(dev)
                    centres[idx] = emb.detach().to(dev, dtype)
                    centre_labels[idx] = y.to(dev).long()
                    written[idx] = True
        finally:
            for m, was_training in modes:
                m.training = was_training
        if bool(out_of_range):
            raise IndexError(f"loader yielded idx outside the bank's rows 0..{n - 1}")
        if _dist.is_distributed():  # this rank's share: exchange rows, check collectively
            return exchange.gather_bank_rows(centres, centre_labels, written)
        missing = n - int(written.sum())
        if missing:
            first = (~written).nonzero()[:5].flatten().tolist()
            raise ValueError(f"the loader never yielded {missing} of the bank's {n} rows "
                             f"(first missing idx: {first}); the bank was left unchanged")
        if not all_finite(centres):
            bad = int((~torch.isfinite(centres)).any(1).sum())
            raise ValueError(f"the model produced NaN/inf embeddings for {bad} rows")
        return centres, centre_labels

    def _progress(self, loader):
        from tqdm.auto import tqdm  # its total: the loader's len(), where it has one
        return tqdm(loader, desc="refresh: embedding", leave=False,
                    disable=not self.progress or not _dist.is_main_process())

    def _swap(self, centres: Tensor, centre_labels: Tensor, neighbours: Tensor,
              stats: RefreshStats, stream: Optional[torch.cuda.Stream]) -> RefreshStats:
        bank = self.bank
        if centres.shape[0] != bank.num_centres:
            raise RuntimeError(f"the bank changed size during the refresh ("
                               f"{centres.shape[0]} -> {bank.num_centres} rows); the new "
                               "bank was discarded")
        if stream is not None:
            # The stream's device is the model's; the bank may be elsewhere (CPU).
            main = torch.cuda.current_stream(stream.device)
            main.wait_stream(stream)
            for t in (centres, centre_labels, neighbours):
                if t.device == main.device:
                    t.record_stream(main)
        bank.update_(centres=centres, centre_labels=centre_labels, neighbours=neighbours)
        self.last_stats = stats
        return stats
