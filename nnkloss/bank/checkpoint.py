"""Saving and loading a CentreBank: atomic writes, safe (weights-only) loads.

A checkpoint holds the centres, labels, log-weights (and whether they are learned), the
neighbour lists and a step counter, plus an optional ``extra`` dict (sigma, a schedule's
``state_dict()``, ...). It is written with :func:`nnkloss.atomic.atomic_write`: a crash or error
mid-write leaves the previous checkpoint intact, never a truncated one.
"""
from __future__ import annotations

import numbers
import os
from typing import Any, Optional, Tuple

import torch

from ..atomic import atomic_write
from .centre_bank import CentreBank, _validate_log_weights

__all__ = ["save_bank", "load_bank"]

_FORMAT = "nnkloss.CentreBank"
_VERSION = 1


def _check_extra(value: Any, where: str = "extra") -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not read back (fail at save time)."""
    if value is None or isinstance(value, (bool, numbers.Integral, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_extra(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, v in value.items():
            if not isinstance(key, (str, numbers.Integral)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int")
            _check_extra(v, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; checkpoints hold only tensors, "
                    "numbers, strings, None and lists/tuples/dicts of them")


def save_bank(bank: CentreBank, path, step: int = 0, extra: Optional[dict] = None) -> None:
    """Write ``bank`` (and ``step``, ``extra``) to ``path`` atomically.

    Args:
        bank: the :class:`CentreBank`; its tensors are copied to the CPU for the file.
        path: target file (str or os.PathLike); its directory must exist.
        step: training step (int >= 0) to resume from.
        extra: optional dict of tensors / numbers / strings / None / nested lists and dicts of
            those (what a weights-only load can read), e.g. ``{"sigma": 10.0}``.
    """
    if not isinstance(bank, CentreBank):
        raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_extra(extra)
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "centres": bank.centres.detach().cpu(),
        "labels": bank.labels.detach().cpu(),
        "neighbours": bank.neighbours.detach().cpu(),
        "log_weights": bank.log_weights.detach().cpu(),
        "learn_weights": bool(bank.learn_weights),
        "uniform_weights": bool(bank._uniform_weights),
        "step": int(step),
        "extra": extra,
    }
    atomic_write(path, lambda f: torch.save(payload, f))


def load_bank(path, map_location=None) -> Tuple[CentreBank, int, Optional[dict]]:
    """Read a checkpoint written by :func:`save_bank`: returns ``(bank, step, extra)``.

    Uses ``torch.load(weights_only=True)``: no arbitrary code runs from the file.
    ``map_location`` as in ``torch.load`` (None: the CPU, where :func:`save_bank` put the
    tensors; e.g. "cuda" to load straight onto the GPU).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path {path!r} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated, foreign or corrupt file
        raise ValueError(f"path {path!r} is not a readable nnkloss CentreBank checkpoint "
                         f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not an nnkloss CentreBank checkpoint")
    if state.get("version", 0) > _VERSION:
        raise ValueError(f"checkpoint version {state['version']} is newer than this nnkloss "
                         f"reads ({_VERSION}); upgrade nnkloss")
    bank = CentreBank(state["centres"], state["labels"], neighbours=state["neighbours"])
    log_w = state["log_weights"]
    if not isinstance(log_w, torch.Tensor):
        raise ValueError("checkpoint log_weights is not a tensor")
    # The same rules as CentreBank.update_ applies to weights (a NaN weight would act as 0,
    # +inf would give an infinite loss).
    _validate_log_weights(log_w, bank.num_centres, learned=bool(state["learn_weights"]),
                          name="checkpoint log_weights")
    log_w = log_w.to(bank.centres.device, torch.float32)
    # Restored as log-weights (exactly as saved), not via weights=exp(.) which would round.
    bank.log_weights.data.copy_(log_w)
    bank._uniform_weights = bool(state["uniform_weights"])
    bank.log_weights.requires_grad_(bool(state["learn_weights"]))
    return bank, int(state["step"]), state["extra"]
