"""Saving and loading a CentreBank: atomic writes, checksummed, safe (weights-only) loads. A
file holds the bank's ``state_dict()``, ``learn_weights``, a step and an optional ``extra``."""
from __future__ import annotations

import numbers
import os
from typing import Optional, Tuple

import torch

from ..atomic import remove_stale_temps
from ..checksum import UncheckedFileError, iter_contents, load_checked, save_checked
from .centre_bank import CentreBank, validate_bank_tensors

__all__ = ["save_bank", "load_bank"]

_FORMAT = "nnkloss.CentreBank"
_VERSION = 2
# Temporaries of interrupted save_bank calls are removed once untouched this long.
STALE_TEMP_SECONDS = 3600.0
# The tensors of a bank file: the keys of CentreBank.state_dict().
_STATE_KEYS = ("centres", "centre_labels", "neighbours", "log_weights")


def save_bank(bank: CentreBank, path, step: int = 0, extra: Optional[dict] = None) -> None:
    """Write ``bank`` (on the CPU), ``step`` (int >= 0) and ``extra`` (tensors, numbers,
    strings, None and containers of them) to ``path`` atomically; its directory must exist.
    Temporaries older than ``STALE_TEMP_SECONDS`` are removed first."""
    if not isinstance(bank, CentreBank):
        raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    for at, v in iter_contents(extra, "extra"):  # what a weights-only load could not read back
        if v is None or isinstance(v, (bool, numbers.Integral, float, str, torch.Tensor, list,
                                       tuple)):
            continue
        if not isinstance(v, dict):
            raise TypeError(f"{at} is a {type(v).__name__}; checkpoints hold only tensors, "
                            "numbers, strings, None and lists/tuples/dicts of them")
        for key in v:
            if not isinstance(key, (str, numbers.Integral)):
                raise TypeError(f"{at} has a key of type {type(key).__name__}; use str or int")
    remove_stale_temps(path, older_than_s=STALE_TEMP_SECONDS)
    payload = {"format": _FORMAT, "version": _VERSION}
    payload.update((name, t.detach().cpu()) for name, t in bank.state_dict().items())
    payload.update(learn_weights=bool(bank.learn_weights), step=int(step), extra=extra)
    save_checked(payload, path)


def load_bank(path, map_location=None, allow_unchecked: bool = False
              ) -> Tuple[CentreBank, int, Optional[dict]]:
    """``(bank, step, extra)`` from a :func:`save_bank` file: checksum verified, weights-only
    load, bank validated (errors name the field, e.g. ``checkpoint neighbours``).
    ``allow_unchecked=True`` also reads files written before checksums (undetected damage)."""
    path = os.fspath(path)
    try:
        state = load_checked(path, map_location, what="CentreBank checkpoint",
                             allow_unchecked=allow_unchecked)
    except UncheckedFileError as exc:
        hint = ("; if it is a CentreBank checkpoint written before checksums, "
                "allow_unchecked=True reads it" if exc.archive else "")
        raise ValueError(f"{exc}. It is not an nnkloss CentreBank checkpoint of this version"
                         f"{hint}") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"{path!r} is not an nnkloss CentreBank checkpoint")
    version = state.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise ValueError(f"checkpoint version must be an int, got {version!r}")
    if version > _VERSION:
        raise ValueError(f"checkpoint version {version} is newer than this nnkloss "
                         f"reads ({_VERSION}); upgrade nnkloss")
    if version < 2 and "labels" in state and "centre_labels" not in state:
        state["centre_labels"] = state.pop("labels")
    missing = [k for k in _STATE_KEYS + ("learn_weights", "step") if k not in state]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {', '.join(missing)}")
    if not isinstance(state["learn_weights"], bool):
        raise ValueError(f"checkpoint learn_weights must be a bool, got "
                         f"{type(state['learn_weights']).__name__}")
    extra = state.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"checkpoint extra must be a dict or None (as save_bank writes it), "
                         f"got {type(extra).__name__}")
    validate_bank_tensors(state["centres"], state["centre_labels"], state["neighbours"],
                          state["log_weights"], learned=state["learn_weights"],
                          prefix="checkpoint ")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    bank = CentreBank(state["centres"], state["centre_labels"], neighbours=state["neighbours"])
    bank.load_state_dict({name: state[name] for name in _STATE_KEYS})
    bank.log_weights.requires_grad_(state["learn_weights"])
    return bank, int(step), extra
