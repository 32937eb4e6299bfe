"""Saving and loading a CentreBank: atomic writes, checksummed, safe (weights-only) loads.

A checkpoint holds the bank's ``state_dict()`` (centres, centre labels, log-weights, neighbour
lists), whether the weights are learned and a step counter, plus an optional ``extra`` dict (sigma, a schedule's
``state_dict()``, ...). It is written with :func:`nnkloss.atomic.atomic_write` behind a sha256
of its payload (:mod:`nnkloss.checksum`): a crash or error mid-write leaves the previous
checkpoint intact, and a damaged file is refused on load. The bank read back is validated as
:meth:`CentreBank.update_` validates writes (shapes, index ranges, label count, finite centres,
weights) before it is built.

Format versions: 2 stores the centre labels as ``centre_labels``; version 1 (and files without
a version) stored the same tensor as ``labels`` and are read by taking it under its new name
(the only difference between the two versions), then validated like any other file.
"""
from __future__ import annotations

import numbers
import os
from typing import Any, Optional, Tuple

import torch

from ..atomic import remove_stale_temps
from ..checksum import UncheckedFileError, iter_contents, load_checked, save_checked
from .centre_bank import CentreBank, validate_bank_tensors

__all__ = ["save_bank", "load_bank"]

_FORMAT = "nnkloss.CentreBank"
_VERSION = 2
# Temporary files of interrupted save_bank calls (a killed process leaves its .tmp beside the
# target) are removed once untouched this long: another process may be writing the same file
# right now, and a write in progress keeps its temporary fresh.
STALE_TEMP_SECONDS = 3600.0
# The tensors of a bank file: the keys of CentreBank.state_dict().
_STATE_KEYS = ("centres", "centre_labels", "neighbours", "log_weights")


def _check_extra(value: Any, where: str = "extra") -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not read back (fail at save time).
    Walked as the checkpoint checks walk (:func:`nnkloss.checksum.iter_contents`: each
    container once, the first bad entry in order reported)."""
    for at, v in iter_contents(value, where):
        if v is None or isinstance(v, (bool, numbers.Integral, float, str, torch.Tensor, list,
                                       tuple)):
            continue
        if not isinstance(v, dict):
            raise TypeError(f"{at} is a {type(v).__name__}; checkpoints hold only tensors, "
                            "numbers, strings, None and lists/tuples/dicts of them")
        for key in v:
            if not isinstance(key, (str, numbers.Integral)):
                raise TypeError(f"{at} has a key of type {type(key).__name__}; use str or int")


def save_bank(bank: CentreBank, path, step: int = 0, extra: Optional[dict] = None) -> None:
    """Write ``bank`` (and ``step``, ``extra``) to ``path`` atomically. Temporary files that
    interrupted writes of ``path`` left behind are removed first, once an hour old
    (``STALE_TEMP_SECONDS``: a write in progress by another process keeps its own fresh).

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
    # The bank's own state_dict (centres, centre_labels, neighbours, log_weights) is the file's
    # payload, beside whether the weights are learned: one description of a bank's state for
    # both ways of saving it (load_bank reads it back through load_state_dict).
    remove_stale_temps(path, older_than_s=STALE_TEMP_SECONDS)
    payload = {"format": _FORMAT, "version": _VERSION}
    payload.update((name, t.detach().cpu()) for name, t in bank.state_dict().items())
    payload.update(learn_weights=bool(bank.learn_weights), step=int(step), extra=extra)
    save_checked(payload, path)


def load_bank(path, map_location=None, allow_unchecked: bool = False
              ) -> Tuple[CentreBank, int, Optional[dict]]:
    """Read a checkpoint written by :func:`save_bank`: returns ``(bank, step, extra)``.

    The payload's sha256 is verified first (a damaged file is a ValueError naming it), then it
    is read with ``torch.load(weights_only=True)`` (no code runs from the file), and the bank is
    validated like :meth:`CentreBank.update_` (an error naming the field, e.g.
    ``checkpoint neighbours``). ``map_location`` as in ``torch.load`` (None: the CPU, where
    :func:`save_bank` put the tensors; e.g. "cuda" to load straight onto the GPU).
    ``allow_unchecked=True`` also reads files written before checkpoints had a checksum
    (weights-only and validated, but damage to them cannot be detected).
    """
    path = os.fspath(path)
    try:
        state = load_checked(path, map_location, what="CentreBank checkpoint",
                             allow_unchecked=allow_unchecked)
    except UncheckedFileError as exc:
        # Reading without the checksum is offered only for what an older nnkloss could have
        # written (a torch.save archive), never for a file that is none.
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
        # Version 1 wrote the centre labels as "labels": same tensor, new name.
        state["centre_labels"] = state.pop("labels")
    missing = [k for k in _STATE_KEYS + ("learn_weights", "step") if k not in state]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {', '.join(missing)}")
    # A bool, as save_bank writes it: bool() of a string is True ("False" loaded a bank with
    # learned weights), of a tensor of several values an error that named nothing.
    if not isinstance(state["learn_weights"], bool):
        raise ValueError(f"checkpoint learn_weights must be a bool, got "
                         f"{type(state['learn_weights']).__name__}")
    extra = state.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"checkpoint extra must be a dict or None (as save_bank writes it), "
                         f"got {type(extra).__name__}")
    # The same rules as CentreBank.update_ (a NaN weight would act as 0, +inf would give an
    # infinite loss, an index >= N would gather another row or fail far from here).
    validate_bank_tensors(state["centres"], state["centre_labels"], state["neighbours"],
                          state["log_weights"], learned=state["learn_weights"],
                          prefix="checkpoint ")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    bank = CentreBank(state["centres"], state["centre_labels"], neighbours=state["neighbours"])
    # Through the bank's own load_state_dict (as a Trainer checkpoint's bank is restored): the
    # log-weights come back exactly as saved (not via weights=exp(.), which would round) and
    # whether they are all one is derived from them there. (Files before this writer also held
    # a "uniform_weights" flag: the same fact, no longer read.)
    bank.load_state_dict({name: state[name] for name in _STATE_KEYS})
    bank.log_weights.requires_grad_(state["learn_weights"])
    return bank, int(step), extra
