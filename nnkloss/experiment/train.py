"""The training loop of the reproduction scripts: :class:`Trainer` and :func:`fit`.

Each epoch reseeds the RNGs from ``(seed, epoch)`` (and the rank), so an interrupted run
repeats itself (leave the loader's ``generator`` unset). Under torchrun
(:mod:`nnkloss.distributed`) the network runs in DDP, steps follow the global-batch mean, the
loss's parameters are averaged across ranks and only rank 0 writes.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import Tensor, nn

from . import checkpoint as _ckpt
from .bank_upkeep import BankUpkeep
from .logs import json_safe, write_logs
from .seeds import check_seed, seed_everything
from ..losses.base import BankLoss
from ..validation import require_positive_int, value_checks, value_checks_enabled
from .. import distributed as _dist
from ..checksum import iter_contents

__all__ = ["Trainer", "fit", "seed_everything", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
#: "adam" decays through the gradient (L2), which Adam rescales; "adamw" decays decoupled.
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# What loading a malformed part raises (AttributeError: a str where a loader wants a dict).
_LOAD_ERRORS = (ValueError, IndexError, TypeError, KeyError, RuntimeError, AttributeError)


def _param_groups(model: nn.Module, criterion: nn.Module, lr: float, weight_decay: float,
                  sigma_lr: Optional[float], weights_lr: Optional[float]) -> List[dict]:
    """The optimiser groups of :class:`Trainer`'s docstring; no decay for "sigma" and "weights"
    (it would pull their logs to 0); a parameter of both model and criterion is the network's."""
    declared = getattr(criterion, "parameter_groups", None)
    declared = declared() if callable(declared) else {"other": list(criterion.parameters())}
    unknown = set(declared) - {"sigma", "weights", "other"}
    if unknown:
        raise ValueError(f"{type(criterion).__name__}.parameter_groups() returned unknown "
                         f"groups {sorted(unknown)} (expected 'sigma', 'weights', 'other')")
    covered = {id(p) for ps in declared.values() for p in ps}
    missing = [n for n, p in criterion.named_parameters() if id(p) not in covered]
    if missing:  # an untrained parameter would be a silent bug
        raise ValueError(f"{type(criterion).__name__}.parameter_groups() leaves out "
                         f"parameters {missing}")
    seen = set()

    def take(params) -> List[Tensor]:
        out = {id(p): p for p in params if p.requires_grad and id(p) not in seen}
        seen.update(out)
        return list(out.values())

    net = take(model.parameters())
    net += take(declared.get("other", ()))
    groups = [{"params": net, "lr": lr, "weight_decay": weight_decay, "name": "network"}]
    for name, rate in (("sigma", sigma_lr), ("weights", weights_lr)):
        params = take(declared.get(name, ()))
        if params:
            groups.append({"params": params, "lr": lr if rate is None else rate,
                           "weight_decay": 0.0, "name": name})
    return groups


class Trainer:
    """Epochs over a loader with a kernel-loss or softmax criterion, logs and checkpoints.

    Args:
        model: maps a batch of inputs to (B, D) embeddings.
        criterion: ``criterion(emb, labels, idx) -> 0-dim loss``: a
            :class:`nnkloss.losses.BankLoss` or any module (SoftmaxHead, ...), trained too by
            its ``parameter_groups()`` ("sigma", "weights", "other"; without one, all "other").
        train_loader: yields ``(inputs, labels, idx)``.
        device: where the model and criterion live.
        optimizer: "sgd" (with ``momentum``), "adam" or "adamw".
        lr, weight_decay: for the network and the criterion's "other" parameters.
        sigma_lr, weights_lr: rates of the "sigma" / "weights" groups (default ``lr``), no decay.
        refresher: a :class:`nnkloss.Refresher`, required for a bank loss: it builds the bank
            before the first step, then per ``schedule`` (in the background if asynchronous).
        schedule: a :class:`nnkloss.RefreshSchedule` (default: every 10 epochs); checkpointed.
        amp: float16 autocast + GradScaler, on CUDA devices only.
        out_dir: where logs and checkpoints go (None: no files).
        seed: base seed in [0, 2**32); epoch e seeds from (seed, e) (and the rank).
        progress, desc: one tqdm bar for the run, and its label.
        eval_fn: ``eval_fn(model, criterion, epoch) -> dict``, run in eval mode under no_grad
            every ``eval_every`` epochs and after the last; logged with the epoch.
        checkpoint_every: epochs between checkpoints (the last epoch always gets one).
        log_every: steps between progress-bar updates (each syncs once).
        grad_clip: clip the gradient norm of all trained parameters (None: off).
        fresh_centres: None or a momentum in [0, 1): after each step the step's embeddings are
            written into the bank at ``idx`` (:meth:`nnkloss.CentreBank.write_centres_`).
        neighbours_every_steps: None or N: every N steps the lists are rebuilt from the
            current centres (:meth:`nnkloss.Refresher.rebuild_neighbours`).
        warm_start_steps: 0 or S: one extra full refresh after step S, so that training does
            not spend a whole interval on centres of the random initialisation.
        threads: None (torch's setting untouched) or the ``torch.set_num_threads`` count for
            :meth:`fit`, restored when it returns.

    Value checks (:func:`nnkloss.value_checks`) run as the caller set them in each :meth:`fit`'s
    first step only (no per-step sync). Rows whose labels disagree with the bank's are dropped
    by the loss and counted; a non-zero count raises ValueError at the epoch's end.
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
                 fresh_centres: Optional[float] = None,
                 neighbours_every_steps: Optional[int] = None, warm_start_steps: int = 0,
                 threads: Optional[int] = None):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.eval_every = require_positive_int("eval_every", eval_every)
        self.checkpoint_every = require_positive_int("checkpoint_every", checkpoint_every)
        self.log_every = require_positive_int("log_every", log_every)
        self.threads = None if threads is None else require_positive_int("threads", threads)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.criterion = criterion.to(self.device)
        # DDP wraps the network only; sync_loss_parameters averages the criterion's.
        self.net = _dist.wrap_model(self.model, self.device)
        self.loader = train_loader
        if isinstance(criterion, BankLoss) and refresher is None:
            raise ValueError(f"a {type(criterion).__name__} needs a refresher to build and "
                             "update its bank (nnkloss.Refresher)")
        self.upkeep = BankUpkeep(self.criterion, self.model, refresher, schedule,
                                 fresh_centres, neighbours_every_steps, warm_start_steps)
        self.refresher, self.schedule = self.upkeep.refresher, self.upkeep.schedule
        groups = _param_groups(model, criterion, lr, weight_decay, sigma_lr, weights_lr)
        extra = {"momentum": momentum} if optimizer == "sgd" else {}
        self.optimizer = OPTIMIZERS[optimizer](groups, lr=lr, **extra)
        self.use_amp = bool(amp) and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.out_dir = out_dir
        self.checkpoint_path = os.path.join(out_dir, CHECKPOINT_NAME) if out_dir else None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        self.seed = check_seed(seed)  # -1 and 2**32 - 1 were one stream (mod 2**32)
        self.progress = progress
        self.eval_fn = eval_fn
        self.grad_clip = grad_clip
        self.desc = desc
        self.epoch = 0          # epochs completed
        self.step = 0           # optimiser steps taken
        self.history: List[Dict[str, Any]] = []
        self._bar = None
        self._check_next_step = True
        # The training data as given (before any refresh): a checkpoint must match it.
        self._data = _ckpt.data_fingerprint(self.criterion)

    def state_dict(self) -> Dict[str, Any]:
        """The full training state, in the form a weights-only load reads back."""
        return {
            "format": _ckpt.FORMAT,
            "data": dict(self._data),
            "epoch": self.epoch,
            "step": self.step,
            "model": self.model.state_dict(),
            "criterion": self.criterion.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": _ckpt.rng_state(),
            "history": self.history,
            "bank_ready": self.upkeep.bank_ready,
            "schedule": self.schedule.state_dict(),
            "refresh_due": self.upkeep.refresh_due,
        }

    def load_state_dict(self, state: Dict[str, Any], where: str = "checkpoint") -> None:
        """Restore :meth:`state_dict`, all or nothing: the data record is checked first
        (ValueError naming what differs), then criterion (bank validated), model and optimiser;
        a refused part puts back every part already loaded. A background refresh in flight is
        finished first (its error raised), so that it cannot overwrite the loaded bank."""
        _ckpt.check_format(state, where)
        _ckpt.check_data(state.get("data"), self._data, where)
        self.upkeep.finish_async()
        now = self.state_dict()  # copied with its tensors cloned to the CPU: deepcopy's memo
        before = copy.deepcopy(now, {id(t): t.detach().to("cpu", copy=True)
                                     for _, t in iter_contents(now) if isinstance(t, Tensor)})
        try:
            self._load_parts(state, where)
        except BaseException:
            self._load_parts(before, "the state before a refused load")
            raise

    def _load_parts(self, state: Dict[str, Any], where: str) -> None:
        for name, target in (("criterion", self.criterion), ("model", self.model),
                             ("optimizer", self.optimizer)):
            try:
                target.load_state_dict(state[name])
                if target is self.optimizer:
                    _ckpt.check_optimizer_state(target)
            except _LOAD_ERRORS as exc:
                raise type(exc)(f"{where}, {name}: {exc}") from exc
        _ckpt.check_scaler_state(state.get("scaler", {}), f"{where}, scaler")
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        _ckpt.check_history(state.get("history"), f"{where}, history")
        self.history = list(state["history"])
        for name, load in (
                ("epoch", lambda v: setattr(self, "epoch", _ckpt.count(v))),
                ("step", lambda v: setattr(self, "step", _ckpt.count(v))),
                ("schedule", self.schedule.load_state_dict),
                ("rng", _ckpt.set_rng_state)):
            try:
                load(state[name])
            except _LOAD_ERRORS as exc:  # e.g. a list where set_rng_state wants a tensor
                raise ValueError(f"{where}, {name}: {exc!r}") from exc
        for name in ("bank_ready", "refresh_due"):  # real bools only: bool("False") is True
            value = state.get(name, False)
            if not isinstance(value, bool):
                raise ValueError(f"{where}, {name}: must be a bool, got {type(value).__name__}")
            setattr(self.upkeep, name, value)

    def save_checkpoint(self, path: Optional[str] = None) -> str:
        """Write the full training state atomically, with its checksum; returns the path."""
        path = path or self.checkpoint_path
        if path is None:
            raise ValueError("no path given and the Trainer has no out_dir")
        return _ckpt.save(path, self.state_dict())

    def load_checkpoint(self, path: Optional[str] = None) -> None:
        """Resume from ``path`` (default ``out_dir/checkpoint.pt``): checksum, weights-only
        load, data check (see :mod:`nnkloss.experiment.checkpoint`)."""
        path = path or self.checkpoint_path
        if path is None or not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        self.load_state_dict(_ckpt.load(path, map_location=self.device),
                             where=f"checkpoint {path!r}")

    def _fit_optimizer_state(self) -> None:
        """Resize optimiser state to parameters resized in place (a grown or shrunk bank's
        ``log_weights``): kept rows keep theirs, new rows start at zero."""
        for p, state in self.optimizer.state.items():
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
        mismatched_sum = torch.zeros((), dtype=torch.int64, device=dev)
        checks = value_checks_enabled()  # as the caller set them around fit()
        rows = 0
        n_batches = 0
        self.upkeep.start_epoch()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        bar = self._bar
        if bar is not None:
            bar.set_description(f"{self.desc} epoch {epoch}/{total_epochs}")
        for n_batches, (x, y, idx) in enumerate(self.loader, 1):
            x = x.to(dev, non_blocking=True)
            y = torch.as_tensor(y).to(dev, non_blocking=True)
            idx = torch.as_tensor(idx).to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
                emb = self.net(x)
            emb = emb.float()  # the loss runs in fp32: half precision hurts its log-sum-exp
            with value_checks(checks and self._check_next_step):
                loss = self.criterion(emb, y, idx)
            self._check_next_step = False
            mismatched = getattr(self.criterion, "last_num_mismatched", None)
            if mismatched is not None:
                mismatched_sum += mismatched
            counted = getattr(self.criterion, "last_num_counted", None)
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
            rows += len(y)
            loss_sum += loss.detach().double()
            if counted is not None:
                valid_sum += counted.double()
            if bar is not None:
                bar.update(1)
                if n_batches % self.log_every == 0:
                    bar.set_postfix(loss=f"{float(loss_sum) / n_batches:.4f}", refresh=False)
            self.upkeep.after_step(self.step, idx, emb)
        if n_batches == 0:
            raise ValueError("the training loader yielded no batches")
        mismatched_sum = int(_dist.sum_over_ranks(mismatched_sum))  # one sync per epoch
        if mismatched_sum:
            raise ValueError(
                f"epoch {epoch}: labels disagreed with the bank's centre_labels at idx in "
                f"{mismatched_sum} training rows (dropped from the loss; no checkpoint written "
                "for this epoch): idx must give each example's own bank row")
        loss_sum, valid_sum = _dist.mean_over_ranks(loss_sum), _dist.sum_over_ranks(valid_sum)
        rows = _dist.sum_over_ranks(rows)
        row: Dict[str, Any] = {"epoch": epoch, "step": self.step,
                               "loss": float(loss_sum) / n_batches,
                               "lr": self.optimizer.param_groups[0]["lr"]}
        if counted is not None:
            row["counted_frac"] = float(valid_sum) / max(rows, 1)
        row.update(getattr(self.criterion, "log_values", dict)())
        row.update(self.upkeep.epoch_columns())
        return row

    def fit(self, epochs: int, resume: bool = True) -> List[Dict[str, Any]]:
        """Train until ``epochs`` epochs are complete; returns the log (one dict per epoch).

        With ``resume`` and an existing ``out_dir/checkpoint.pt``, training continues from it
        (a run that already reached ``epochs`` does nothing more).
        """
        if resume and self.checkpoint_path and os.path.isfile(self.checkpoint_path):
            self.load_checkpoint()
        saved_threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            if self.upkeep.needs_initial_bank:
                seed_everything(self.seed)
            self.model.train()
            self.upkeep.before_fit(more_epochs=self.epoch < int(epochs))
            self._check_next_step = True  # each fit()'s first step runs with value checks
            if self.progress and self.epoch < int(epochs) and _dist.is_main_process():
                from tqdm.auto import tqdm
                per_epoch = len(self.loader) if hasattr(self.loader, "__len__") else None
                total = None if per_epoch is None else per_epoch * (int(epochs) - self.epoch)
                self._bar = tqdm(total=total, desc=self.desc, unit="step")
            self._run_epochs(int(epochs))
        finally:
            torch.set_num_threads(saved_threads)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return self.history

    def _run_epochs(self, epochs: int) -> None:
        for epoch in range(self.epoch + 1, int(epochs) + 1):
            # Each rank its own stream; rank 0 keeps the published runs' stream.
            rank = _dist.rank()
            if rank == 0:
                seed_everything((self.seed * 1_000_003 + epoch) % 2 ** 32)
            else:
                seed_everything(self.seed, epoch, rank)
            _dist.set_sampler_epoch(self.loader, epoch)  # a DistributedSampler's shuffle
            t0 = time.perf_counter()
            row = self._train_epoch(epoch, int(epochs))
            row.update(self.upkeep.take_pending())  # the initial bank's start_refresh_*
            row["time_s"] = time.perf_counter() - t0
            last = epoch == int(epochs)
            if self.eval_fn is not None and (epoch % self.eval_every == 0 or last):
                self.model.eval()
                self.criterion.eval()
                with torch.no_grad():
                    metrics = self.eval_fn(self.model, self.criterion, epoch) or {}
                self.model.train()
                self.criterion.train()
                row.update({k: json_safe(v) for k, v in metrics.items()})
            self.epoch = epoch
            # Before the checkpoint, so that a resumed run starts from this bank.
            row.update(self.upkeep.end_epoch(last))
            if last or (self.out_dir and epoch % self.checkpoint_every == 0):
                row.update(self.upkeep.finish_async())  # checkpoints hold a settled bank
            self.history.append(row)
            if self.out_dir and _dist.is_main_process():
                write_logs(self.out_dir, self.history)
            if self.out_dir and (epoch % self.checkpoint_every == 0 or last):
                if _dist.is_main_process():  # every rank holds the same state
                    self.save_checkpoint()
                _dist.barrier()  # no rank reads the checkpoint before rank 0 wrote it
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{row['loss']:.4f}")


def fit(model: nn.Module, criterion: nn.Module, train_loader: Iterable, epochs: int,
        resume: bool = True, **kwargs) -> Trainer:
    """A :class:`Trainer` of ``kwargs``, trained ``epochs`` epochs (``.history``: the log)."""
    trainer = Trainer(model, criterion, train_loader, **kwargs)
    trainer.fit(epochs, resume=resume)
    return trainer
