"""Training-loop helpers shared by the reproduction scripts: :class:`Trainer` and :func:`fit`.

One loop serves the kernel loss and the softmax baseline, because both criteria are called the
same way, ``criterion(emb, labels, idx) -> 0-dim loss``:

* :class:`nnkloss.NeighbourKernelLoss` over a :class:`nnkloss.CentreBank` of the training set,
  kept current by a Refresher (:mod:`nnkloss.bank.refresh`): the bank is built before the first
  step and rebuilt every refresh interval (the papers' "update interval");
* :class:`nnkloss.experiment.models.SoftmaxHead` (linear layer + cross-entropy).

The loader yields ``(inputs, labels, idx)`` with ``idx`` the bank rows of the batch (the
datasets in :mod:`nnkloss.experiment.datasets` do).

Outputs in ``out_dir`` (all written atomically: temporary file, then rename):

* ``log.csv`` and ``log.json``: one row per epoch (loss, learning rate, sigma, timings,
  refresh statistics, and whatever ``eval_fn`` returns);
* ``checkpoint.pt``: model, criterion (with the bank: centres, labels, neighbour lists,
  weights, sigma), optimiser, AMP scaler, epoch, step, RNG states and the log so far.

``fit(..., resume=True)`` continues from ``checkpoint.pt``: same parameters, same bank, same
optimiser state, the log continued where the checkpoint left it. Every epoch reseeds the RNGs
from ``(seed, epoch)`` so that shuffling and dropout of epoch e are the same whether or not the
run was interrupted before it (leave the DataLoader's ``generator`` unset for this: it then
draws from torch's global RNG).

Under torchrun (after :func:`nnkloss.bank.distributed.init_from_env`) the same loop runs one process
per GPU: give it loaders over each rank's share (:func:`nnkloss.bank.distributed.shard_loader`); the
network is wrapped in DDP, each step follows the mean over the global batch, sigma and the bank
weights are averaged across ranks, the log shows the whole job and only rank 0 writes files.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import random
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..atomic import atomic_write
from ..validation import require_positive_int
from ..bank.refresh import RefreshSchedule
from ..losses.base import BankLoss
from ..bank import distributed as _dist

__all__ = ["Trainer", "fit", "seed_everything", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
LOG_CSV = "log.csv"
LOG_JSON = "log.json"
_FORMAT = "nnkloss.trainer/1"
#: "adam" adds weight decay to the gradient (L2), which Adam then rescales: when the loss
#: gradient is tiny (e.g. sigma much larger than the embedding distances) the decay alone is
#: normalised to full-size steps and shrinks the network. "adamw" decays decoupled from it.
OPTIMIZERS = ("sgd", "adam", "adamw")


# ---------------------------------------------------------------------------- utilities
def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and all CUDA devices) global RNGs."""
    seed = int(seed) % (2 ** 32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _json_safe(v):
    if isinstance(v, Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _param_groups(model: nn.Module, criterion: nn.Module, lr: float, weight_decay: float,
                  sigma_lr: Optional[float], weights_lr: Optional[float]) -> List[dict]:
    """Network (+ softmax head) parameters decay; sigma and the bank weights get their own
    learning rates and no weight decay (decay would pull log-sigma and log-weights to 0)."""
    net, sig, wts = [], [], []
    seen = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            net.append(p)
    for name, p in criterion.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("log_sigma"):
            sig.append(p)
        elif name.endswith("log_weights"):
            wts.append(p)
        else:
            net.append(p)
    groups = [{"params": net, "lr": lr, "weight_decay": weight_decay, "name": "network"}]
    if sig:
        groups.append({"params": sig, "lr": lr if sigma_lr is None else sigma_lr,
                       "weight_decay": 0.0, "name": "sigma"})
    if wts:
        groups.append({"params": wts, "lr": lr if weights_lr is None else weights_lr,
                       "weight_decay": 0.0, "name": "weights"})
    return groups


def _stats_dict(stats) -> Dict[str, Any]:
    """Numeric fields of whatever a Refresher's ``refresh()`` returns, for the log."""
    if stats is None:
        return {}
    if hasattr(stats, "_asdict"):
        stats = stats._asdict()
    elif not isinstance(stats, dict) and hasattr(stats, "__dict__"):
        stats = vars(stats)
    if not isinstance(stats, dict):
        return {}
    out = {}
    for k, v in stats.items():
        v = _json_safe(v)
        if isinstance(v, (int, float, bool)) and not isinstance(v, list):
            out[f"refresh_{k}"] = v
    return out


# ---------------------------------------------------------------------------- trainer
class Trainer:
    """Epochs over a loader with a kernel-loss or softmax criterion, logs and checkpoints.

    Args:
        model: maps a batch of inputs to (B, D) embeddings.
        criterion: ``criterion(emb, labels, idx) -> 0-dim loss``: a bank loss
            (:class:`nnkloss.losses.BankLoss`: NeighbourKernelLoss, ClassConditionalLoss, whose
            ``last_num_valid``, ``kernel_sigma()`` and ``log_values()`` the loop uses) or any
            other module (SoftmaxHead, ...). Its parameters (softmax head, sigma, bank weights)
            are trained too.
        train_loader: yields ``(inputs, labels, idx)``.
        device: where the model and criterion live ("cpu", "cuda", ...).
        optimizer: "sgd" (momentum ``momentum``), "adam" or "adamw" (decoupled decay).
        lr, weight_decay: for the network (and softmax head).
        sigma_lr, weights_lr: learning rates of a learned sigma / learned bank weights
            (default: ``lr``); no weight decay on them.
        refresher: object with ``refresh()`` that re-embeds the training set into the bank and
            rebuilds the neighbour lists (:class:`nnkloss.bank.refresh.Refresher`). Required for
            a NeighbourKernelLoss; it runs before the first step and then per ``schedule``.
            With ``async_mode=True`` the scheduled refreshes run in the background and are
            swapped in at the first step after they finish; one still in flight is waited for
            before a checkpoint (so checkpoint less often than you refresh to keep the gain).
        schedule: the :class:`nnkloss.RefreshSchedule` that drives the refreshes (its
            ``step()`` after each optimiser step, ``epoch_end()`` after each epoch; its state is
            saved in checkpoints); default: every 10 epochs (the papers).
        amp: mixed precision (float16 autocast + GradScaler); used only on CUDA devices.
        out_dir: where logs and checkpoints go (None: no files).
        seed: base seed; epoch e runs with RNGs seeded from (seed, e).
        progress: tqdm progress bars.
        eval_fn: ``eval_fn(model, criterion, epoch) -> dict`` of metrics, called in eval mode
            under no_grad every ``eval_every`` epochs and after the last; logged with the epoch.
        checkpoint_every: epochs between checkpoints (the last epoch always gets one).
        log_every: steps between progress-bar updates (each reads the running loss: one sync).
        grad_clip: clip the gradient norm of all trained parameters to this (None: off).

    Keeping a bank loss current on a network that moves fast (training from scratch), where
    the centres of a periodic refresh go stale within an epoch:

        fresh_centres: None (off) or a momentum in [0, 1): after each optimiser step, the
            step's embeddings are written into the bank at their ``idx``
            (:meth:`nnkloss.CentreBank.write_centres_`: ``momentum * old + (1 - momentum) *
            new``; a row twice in a batch keeps its last occurrence). They are the embeddings
            the loss saw in that step's forward: the network in train mode (dropout, batch
            statistics) on the training loader's (augmented) inputs, before the step's update;
            under AMP the fp32 copy of the autocast output that the loss ran on, cast to the
            bank's dtype. Rows not in the batch keep their centres. Under torch.distributed
            every rank all-gathers every rank's (idx, embeddings) and writes all of them in
            rank order (rank 0's first, so a row in two ranks' batches ends with the higher
            rank's embedding): the banks stay identical. Costs per step there: an all-gather of
            the batch sizes (one host sync on NCCL) and of the B x D embeddings. A background
            (async) refresh swapped in later replaces every centre, including rows written
            since its snapshot, with its re-embedded (older) ones; a scheduled synchronous
            refresh at the same step runs after the write and replaces it too.
        lists_every_steps: None (off) or N: every N optimiser steps (counted over the whole
            run, so a resumed run rebuilds at the same steps) the neighbour lists are rebuilt
            from the bank's current centres with the refresher's k, search backend,
            ensure_positive and knn options (:meth:`nnkloss.Refresher.rebuild_lists`), with no
            re-embedding pass. Skipped at a step whose scheduled synchronous refresh rebuilds
            them anyway. The epoch log gets ``lists_rebuilds``, ``lists_time_s`` (total wall
            time), ``lists_overlap`` (mean share of list entries kept per rebuild),
            ``lists_positive_share`` and ``lists_mean_kernel`` (last rebuild of the epoch).
        warm_start_steps: 0 (off) or S: one extra full refresh after the S-th optimiser step
            (besides the initial bank built before step 1 and the ``schedule``'s), so that
            the network does not train for a whole interval against centres of its random
            initialisation. Runs the refresher's way (in the background with ``async_mode``).
    """

    def __init__(self, model: nn.Module, criterion: nn.Module, train_loader: Iterable, *,
                 device="cpu", optimizer: str = "sgd", lr: float = 1e-5,
                 weight_decay: float = 2e-4, momentum: float = 0.9,
                 sigma_lr: Optional[float] = None, weights_lr: Optional[float] = None,
                 refresher=None, schedule=None, amp: bool = False,
                 out_dir: Optional[str] = None, seed: int = 0, progress: bool = True,
                 eval_fn: Optional[Callable[[nn.Module, nn.Module, int], Dict[str, float]]] = None,
                 eval_every: int = 1, checkpoint_every: int = 1, log_every: int = 10,
                 grad_clip: Optional[float] = None, desc: str = "train",
                 fresh_centres: Optional[float] = None, lists_every_steps: Optional[int] = None,
                 warm_start_steps: int = 0):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        for name, v in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every),
                        ("log_every", log_every)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.criterion = criterion.to(self.device)
        # torch.distributed (torchrun): DDP around the network only, the criterion's parameters
        # are averaged by sync_loss_parameters (see nnkloss.bank.distributed). Else self.model.
        self.net = _dist.wrap_model(self.model, self.device)
        self.loader = train_loader
        if isinstance(criterion, BankLoss) and refresher is None:
            raise ValueError(f"a {type(criterion).__name__} needs a refresher to build and "
                             "update its bank (nnkloss.Refresher)")
        # No refresher (a softmax head): nothing to refresh, whatever the schedule says.
        self.refresher = refresher
        if schedule is None:
            schedule = RefreshSchedule(every_epochs=10)  # the papers' update interval
        elif not isinstance(schedule, RefreshSchedule):
            raise TypeError(f"schedule must be a nnkloss.RefreshSchedule, got "
                            f"{type(schedule).__name__}")
        self.schedule = schedule
        self.fresh_centres, self.lists_every_steps, self.warm_start_steps = _check_bank_options(
            criterion, refresher, fresh_centres, lists_every_steps, warm_start_steps)
        groups = _param_groups(model, criterion, lr, weight_decay, sigma_lr, weights_lr)
        if optimizer == "sgd":
            self.optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum)
        elif optimizer == "adam":
            self.optimizer = torch.optim.Adam(groups, lr=lr)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=lr)
        self.use_amp = bool(amp) and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.out_dir = out_dir
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        self.seed = int(seed)
        self.progress = progress
        self.eval_fn = eval_fn
        self.eval_every = int(eval_every)
        self.checkpoint_every = int(checkpoint_every)
        self.log_every = int(log_every)
        self.grad_clip = grad_clip
        self.desc = desc
        self.epoch = 0          # epochs completed
        self.step = 0           # optimiser steps taken
        self.history: List[Dict[str, Any]] = []
        self._bank_ready = False
        # The last epoch of a fit() skips its scheduled refresh (nothing would use it); a
        # later fit() that continues from there must do it first, as an uninterrupted run did.
        self._refresh_due = False
        self._refresh_log: Dict[str, Any] = {}
        self._bar = None

    # ------------------------------------------------------------------ paths & state
    @property
    def checkpoint_path(self) -> Optional[str]:
        return os.path.join(self.out_dir, CHECKPOINT_NAME) if self.out_dir else None

    def state_dict(self) -> Dict[str, Any]:
        return {
            "format": _FORMAT,
            "epoch": self.epoch,
            "step": self.step,
            "model": self.model.state_dict(),
            "criterion": self.criterion.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": _rng_state(),
            "history": self.history,
            "bank_ready": self._bank_ready,
            "schedule": self.schedule.state_dict(),
            "refresh_due": self._refresh_due,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a Trainer checkpoint (format {state.get('format')!r})")
        self.model.load_state_dict(state["model"])
        self.criterion.load_state_dict(state["criterion"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.history = list(state["history"])
        self._bank_ready = bool(state.get("bank_ready", False))
        # The schedule's counters (older checkpoints: the trainer's own).
        self.schedule.load_state_dict(state.get("schedule", {"epoch": self.epoch,
                                                             "global_step": self.step}))
        self._refresh_due = bool(state.get("refresh_due", False))
        _set_rng_state(state["rng"])

    def save_checkpoint(self, path: Optional[str] = None) -> str:
        """Write the full training state atomically; returns the path."""
        path = path or self.checkpoint_path
        if path is None:
            raise ValueError("no path given and the Trainer has no out_dir")
        state = self.state_dict()
        return atomic_write(path, lambda f: torch.save(state, f))

    def load_checkpoint(self, path: Optional[str] = None) -> None:
        path = path or self.checkpoint_path
        if path is None or not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        try:
            # Our own file: it holds RNG states and the log (Python objects), not only tensors.
            state = torch.load(path, map_location=self.device, weights_only=False)
        except Exception as e:
            raise ValueError(f"cannot read checkpoint {path}: {e}") from None
        if "rng" in state:  # RNG states must stay CPU ByteTensors whatever map_location did
            rng = state["rng"]
            rng["torch"] = rng["torch"].cpu()
            if "cuda" in rng:
                rng["cuda"] = [s.cpu() for s in rng["cuda"]]
        self.load_state_dict(state)

    def write_logs(self) -> None:
        """(Re)write log.json and log.csv from ``history`` (atomically; rank 0 only)."""
        if not self.out_dir or not _dist.is_main_process():
            return
        rows = [{k: _json_safe(v) for k, v in r.items()} for r in self.history]
        atomic_write(os.path.join(self.out_dir, LOG_JSON),
                     json.dumps(rows, indent=1).encode("utf-8"))
        cols: List[str] = []
        for r in rows:
            cols += [k for k in r if k not in cols]
        sio = io.StringIO()
        w = csv.DictWriter(sio, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        atomic_write(os.path.join(self.out_dir, LOG_CSV), sio.getvalue().encode("utf-8"))

    # ------------------------------------------------------------------ refresh
    @property
    def _async(self) -> bool:
        return bool(getattr(self.refresher, "async_mode", False))

    def refresh(self, wait: bool = True) -> Dict[str, Any]:
        """Re-embed the training set into the bank and rebuild the neighbour lists.

        With an asynchronous refresher and ``wait=False`` this only starts the background
        refresh (returns {}); the training loop swaps it in when it is ready (``poll()``)."""
        sigma = self.criterion.kernel_sigma()
        if self._async and not wait:
            if not self.refresher.in_flight:
                self.refresher.refresh_async(sigma)
            return {}
        was_training = self.model.training
        t0 = time.perf_counter()
        try:
            if self._async and self.refresher.in_flight:
                self.refresher.wait()  # finish the one in flight first, then a fresh one
            stats = self.refresher.refresh(sigma)
        finally:
            self.model.train(was_training)
        self._bank_ready = True
        out = _stats_dict(stats)
        out["refresh_time_s"] = time.perf_counter() - t0
        return out

    def _finish_async(self) -> Dict[str, Any]:
        """Swap in a background refresh still in flight (before checkpoints and at the end)."""
        if self.refresher is not None and self._async and self.refresher.in_flight:
            return _stats_dict(self.refresher.wait())
        return {}

    # ------------------------------------------------------------------ loop
    def _fit_optimizer_state(self) -> None:
        """A bank grown (or shrunk) between epochs resizes its learned ``log_weights`` in place
        (same Parameter, still in the optimiser); resize the optimiser's per-parameter state of
        the old shape to match: kept rows keep theirs, new rows start at zero."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                for key, v in list(state.items()):
                    if (isinstance(v, Tensor) and v.dim() == p.dim() and v.dim() > 0
                            and v.shape != p.shape):
                        fitted = torch.zeros_like(p, dtype=v.dtype)
                        common = tuple(slice(0, min(a, b)) for a, b in zip(v.shape, p.shape))
                        fitted[common] = v[common]
                        state[key] = fitted

    def _train_epoch(self, epoch: int, total_epochs: int) -> Dict[str, Any]:
        self._fit_optimizer_state()
        self.model.train()
        self.criterion.train()
        dev = self.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        valid_sum = torch.zeros((), dtype=torch.float64, device=dev)
        rows = 0
        n_batches = 0
        refreshes: Dict[str, Any] = {}
        lists_log: Dict[str, Any] = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        bar = self._bar
        if bar is not None:
            bar.set_description(f"{self.desc} epoch {epoch}/{total_epochs}")
        for x, y, idx in self.loader:
            x = x.to(dev, non_blocking=True)
            y = torch.as_tensor(y).to(dev, non_blocking=True)
            idx = torch.as_tensor(idx).to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
                emb = self.net(x)
            # The loss runs in fp32 outside autocast: its log-sum-exp and the squared
            # distances are where half precision would hurt.
            emb = emb.float()
            loss = self.criterion(emb, y, idx)
            # Under DDP: gradients of the mean over the global batch (no-op in one process).
            counted = getattr(self.criterion, "last_num_valid", None)
            loss = _dist.global_mean(loss, len(y) if counted is None else counted)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            _dist.sync_loss_parameters(self.criterion)
            if self.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step += 1
            if self.fresh_centres is not None:
                _write_fresh_centres(self.criterion.bank, idx, emb.detach(), self.fresh_centres)
            n_batches += 1
            rows += len(y)
            loss_sum += loss.detach().double()
            if counted is not None:
                valid_sum += counted.double()
            if bar is not None:
                bar.update(1)
                if n_batches % self.log_every == 0:
                    bar.set_postfix(loss=f"{float(loss_sum) / n_batches:.4f}", refresh=False)
            if self.refresher is not None and self._async and self.refresher.in_flight:
                done = self.refresher.poll()  # a thread liveness check: no sync
                if done is not None:
                    refreshes = _stats_dict(done)
            due = self.schedule.step() or self.step == self.warm_start_steps
            due = due and self.refresher is not None
            if (self.lists_every_steps is not None and self.step % self.lists_every_steps == 0
                    and not (due and not self._async)):  # a synchronous refresh does it now
                lists_log = self._rebuild_lists(lists_log)
            if due:
                refreshes = self.refresh(wait=False) or refreshes
                self.model.train()
        if n_batches == 0:
            raise ValueError("the training loader yielded no batches")
        # The log shows the whole job: global_mean's per-rank values average to the global loss.
        loss_sum, valid_sum = _dist.mean_over_ranks(loss_sum), _dist.sum_over_ranks(valid_sum)
        rows = _dist.sum_over_ranks(rows)
        row: Dict[str, Any] = {"epoch": epoch, "step": self.step,
                               "loss": float(loss_sum) / n_batches,
                               "lr": self.optimizer.param_groups[0]["lr"]}
        if counted is not None:
            row["valid_frac"] = float(valid_sum) / max(rows, 1)
        row.update(getattr(self.criterion, "log_values", dict)())
        row.update(refreshes)
        row.update(_lists_row(lists_log))
        return row

    def _rebuild_lists(self, log: Dict[str, Any]) -> Dict[str, Any]:
        """Lists from the bank's current centres (``lists_every_steps``); accumulates the
        epoch's statistics in ``log``."""
        t0 = time.perf_counter()
        stats = self.refresher.rebuild_lists(self.criterion.kernel_sigma())
        log["rebuilds"] = log.get("rebuilds", 0) + 1
        log["time_s"] = log.get("time_s", 0.0) + time.perf_counter() - t0
        if stats.overlap is not None:
            log.setdefault("overlaps", []).append(stats.overlap)
        log["positive_share"] = stats.positive_share
        log["mean_kernel"] = stats.mean_kernel
        return log

    def fit(self, epochs: int, resume: bool = True) -> List[Dict[str, Any]]:
        """Train until ``epochs`` epochs are complete; returns the log (one dict per epoch).

        With ``resume`` and an existing ``out_dir/checkpoint.pt``, training continues from it
        (a run that already reached ``epochs`` does nothing more).
        """
        if resume and self.checkpoint_path and os.path.isfile(self.checkpoint_path):
            self.load_checkpoint()
        if self.refresher is not None and not self._bank_ready:
            # The initial bank: centres from the untrained model, before the first step.
            seed_everything(self.seed)
            self._refresh_log = self.refresh()
        elif self.refresher is not None and self._refresh_due and self.epoch < int(epochs):
            self._refresh_log = self.refresh()  # skipped after the epoch we resume from
        if self.epoch < int(epochs):
            self._refresh_due = False
        self.model.train()
        self._bar = None
        if self.progress and self.epoch < int(epochs) and _dist.is_main_process():
            from tqdm.auto import tqdm
            per_epoch = len(self.loader) if hasattr(self.loader, "__len__") else None
            total = None if per_epoch is None else per_epoch * (int(epochs) - self.epoch)
            # One bar for the whole run (not one per epoch): readable in logs and notebooks.
            self._bar = tqdm(total=total, desc=self.desc, unit="step")
        try:
            self._run_epochs(int(epochs))
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return self.history

    def _run_epochs(self, epochs: int) -> None:
        for epoch in range(self.epoch + 1, int(epochs) + 1):
            seed_everything(self.seed * 1_000_003 + epoch)
            _dist.set_sampler_epoch(self.loader, epoch)  # a DistributedSampler's shuffle
            t0 = time.perf_counter()
            row = self._train_epoch(epoch, int(epochs))
            if self._refresh_log:  # the initial bank build, logged with the first epoch
                for k, v in self._refresh_log.items():
                    row.setdefault(k, v)
                self._refresh_log = {}
            row["time_s"] = time.perf_counter() - t0
            last = epoch == int(epochs)
            if self.eval_fn is not None and (epoch % self.eval_every == 0 or last):
                self.model.eval()
                self.criterion.eval()
                with torch.no_grad():
                    metrics = self.eval_fn(self.model, self.criterion, epoch) or {}
                self.model.train()
                self.criterion.train()
                row.update({k: _json_safe(v) for k, v in metrics.items()})
            self.epoch = epoch
            # Refresh at the end of every interval (not after the last epoch: nothing would
            # use it), before the checkpoint, so that a resumed run starts from this bank.
            due = self.schedule.epoch_end() and self.refresher is not None
            if due and not last:
                row.update(self.refresh(wait=False))
            self._refresh_due = due and last
            if last or (self.out_dir and epoch % self.checkpoint_every == 0):
                row.update(self._finish_async())  # checkpoints hold a settled bank
            self.history.append(row)
            self.write_logs()
            if (self.out_dir and (epoch % self.checkpoint_every == 0 or last)
                    and _dist.is_main_process()):  # every rank holds the same state
                self.save_checkpoint()
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{row['loss']:.4f}")


def _check_bank_options(criterion, refresher, fresh_centres, lists_every_steps,
                        warm_start_steps):
    """Validate the Trainer's bank options; returns them normalised."""
    if fresh_centres is not None:
        if isinstance(fresh_centres, bool) or not isinstance(fresh_centres, (int, float, np.number)):
            raise TypeError(f"fresh_centres must be None or a momentum in [0, 1), got "
                            f"{type(fresh_centres).__name__}")
        fresh_centres = float(fresh_centres)
        if not 0.0 <= fresh_centres < 1.0:
            raise ValueError(f"fresh_centres must be None or a momentum in [0, 1), got "
                             f"{fresh_centres}")
    if lists_every_steps is not None:
        lists_every_steps = require_positive_int("lists_every_steps", lists_every_steps)
    if (isinstance(warm_start_steps, bool) or not isinstance(warm_start_steps, (int, np.integer))
            or warm_start_steps < 0):
        raise ValueError(f"warm_start_steps must be an int >= 0, got {warm_start_steps!r}")
    warm_start_steps = int(warm_start_steps)
    wanted = [name for name, on in (("fresh_centres", fresh_centres is not None),
                                    ("lists_every_steps", lists_every_steps is not None),
                                    ("warm_start_steps", warm_start_steps > 0)) if on]
    if wanted and not isinstance(criterion, BankLoss):
        raise ValueError(f"{', '.join(wanted)} need a criterion with a bank (a "
                         f"nnkloss.losses.BankLoss), got {type(criterion).__name__}")
    if lists_every_steps is not None and not callable(getattr(refresher, "rebuild_lists", None)):
        raise TypeError("lists_every_steps needs a refresher with rebuild_lists() "
                        "(nnkloss.Refresher)")
    return fresh_centres, lists_every_steps, warm_start_steps


@torch.no_grad()
def _write_fresh_centres(bank, idx: Tensor, emb: Tensor, momentum: float) -> None:
    """``bank.write_centres_`` with this step's rows; under torch.distributed with every
    rank's rows, gathered in rank order, so that every rank's bank gets the same writes."""
    idx = idx.to(bank.centres.device)
    emb = emb.to(bank.centres.device)
    if _dist.is_distributed():
        idx, emb = _gather_batch_rows(idx, emb)
    bank.write_centres_(idx, emb, momentum)


def _gather_batch_rows(idx: Tensor, emb: Tensor):
    """Every rank's (idx (B_r,), emb (B_r, D)), concatenated in rank order, on every rank."""
    comm = _dist._comm_device(None, emb.device)
    size = torch.tensor([idx.shape[0]], dtype=torch.int64, device=comm)
    counts = [int(c) for c in _dist._all_gather_same(size, None)]  # NCCL: one host sync
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    all_idx = torch.empty(offsets[-1], dtype=torch.int64, device=emb.device)
    all_emb = torch.empty(offsets[-1], emb.shape[1], dtype=emb.dtype, device=emb.device)

    def placer(out: Tensor):
        def place(r: int, first: int, rows: Tensor) -> None:
            out[offsets[r] + first: offsets[r] + first + rows.shape[0]] = rows.to(out.device)
        return place

    _dist._all_gather_rows(idx.long(), counts, placer(all_idx), None, comm)
    _dist._all_gather_rows(emb.contiguous(), counts, placer(all_emb), None, comm)
    return all_idx, all_emb


def _lists_row(log: Dict[str, Any]) -> Dict[str, Any]:
    """The epoch log's ``lists_*`` columns from :meth:`Trainer._rebuild_lists`' statistics."""
    if not log:
        return {}
    row = {"lists_rebuilds": log["rebuilds"], "lists_time_s": log["time_s"],
           "lists_positive_share": log["positive_share"]}
    if log.get("overlaps"):
        row["lists_overlap"] = float(np.mean(log["overlaps"]))
    if log.get("mean_kernel") is not None:
        row["lists_mean_kernel"] = log["mean_kernel"]
    return row


def fit(model: nn.Module, criterion: nn.Module, train_loader: Iterable, epochs: int,
        resume: bool = True, **kwargs) -> Trainer:
    """Build a :class:`Trainer` (``kwargs`` are its options), train ``epochs`` epochs, and
    return it (``.history`` holds the log)."""
    trainer = Trainer(model, criterion, train_loader, **kwargs)
    trainer.fit(epochs, resume=resume)
    return trainer
