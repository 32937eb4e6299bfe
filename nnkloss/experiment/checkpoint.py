"""The Trainer's checkpoint file: its format, checksummed weights-only load, and checks of
what PyTorch's own loaders take as it comes (data record, optimiser state, AMP scaler, history,
epoch and step).
"""
from __future__ import annotations

import hashlib
import math
import os
import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch import nn

from ..atomic import remove_stale_temps
from ..bank.centre_bank import CentreBank
from ..checksum import UncheckedFileError, load_checked, save_checked

__all__ = ["FORMAT", "save", "load", "rng_state", "set_rng_state", "data_fingerprint",
           "check_format", "check_data", "check_optimizer_state", "check_history",
           "check_scaler_state"]

FORMAT = "nnkloss.trainer/3"


def rng_state() -> Dict[str, Any]:
    """Python's, NumPy's and torch's (CPU, CUDA) RNG states in weights-only form."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": int(version),
                        "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss},
             "numpy": {"bit_generator": str(name),
                       "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (tensors may be on any device)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()),
                     py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["keys"].cpu().numpy().astype(np.uint32),
                         int(npy["pos"]), int(npy["has_gauss"]), float(npy["cached_gaussian"])))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        # States of GPUs this machine lacks are left out.
        for i, s in enumerate(list(state["cuda"])[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


def data_fingerprint(criterion: nn.Module) -> Dict[str, Any]:
    """What a resumed run must share with the checkpoint's: a bank loss's N, embedding size
    and sha256 of its centre labels; {} for other criteria."""
    bank = getattr(criterion, "bank", None)
    if not isinstance(bank, CentreBank):
        return {}
    centre_labels = bank.centre_labels.detach().to("cpu", torch.int64).contiguous()
    return {"num_centres": int(bank.num_centres), "embedding_dim": int(bank.dim),
            "centre_labels_sha256": hashlib.sha256(centre_labels.numpy().tobytes()).hexdigest()}


def check_data(saved: Any, current: Dict[str, Any], where: str = "checkpoint") -> None:
    """ValueError naming every difference between the saved and current data records."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where} has no data record (N, centre labels, embedding size)")
    problems = [f"{what}: {saved.get(key)} in the checkpoint, {current.get(key)} now"
                for key, what in (("num_centres", "N (training examples, bank rows)"),
                                  ("embedding_dim", "embedding size"))
                if saved.get(key) != current.get(key)]
    if saved.get("centre_labels_sha256") != current.get("centre_labels_sha256"):
        problems.append("centre_labels: the training labels (the bank's centre labels, in "
                        "row order) differ from those the checkpoint was trained on")
    if problems:
        raise ValueError(f"{where} does not belong to this training data: " + "; ".join(problems))


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless every state tensor of ``optimizer`` is 0-dim or of its parameter's
    shape, and every numeric hyperparameter (numbers or tuples of them by
    ``optimizer.defaults``) is finite and >= 0: ``load_state_dict`` checks neither."""
    for g, group in enumerate(optimizer.param_groups):
        for key, default in optimizer.defaults.items():
            value = group.get(key)
            if _is_number(default):
                ok = _nonnegative_number(value)
            elif isinstance(default, tuple) and default and all(map(_is_number, default)):
                ok = (isinstance(value, (tuple, list)) and len(value) == len(default)
                      and all(map(_nonnegative_number, value)))
            else:
                continue
            if not ok:
                raise ValueError(f"the optimiser state: parameter group {g}'s {key!r} must be "
                                 f"{'a number' if _is_number(default) else 'numbers'} finite "
                                 f"and >= 0 (default {default!r}), got {value!r}")
        for i, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(f"the optimiser state {key!r} of parameter {i} of its group "
                                     f"has shape {tuple(value.shape)}, the parameter "
                                     f"{tuple(p.shape)}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nonnegative_number(v: Any) -> bool:
    """A finite number >= 0: an int, float or one-value float tensor."""
    if isinstance(v, torch.Tensor):
        return (v.numel() == 1 and v.is_floating_point() and bool(torch.isfinite(v).all())
                and float(v) >= 0)
    return _is_number(v) and math.isfinite(v) and v >= 0


def count(value: Any) -> int:
    """A checkpoint's epoch or step: an int >= 0 (bools and other types refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be an int >= 0, got {value!r}")
    return value


def check_scaler_state(state: Any, what: str = "scaler") -> None:
    """ValueError unless ``state`` is empty or a GradScaler state its constructor allows
    (``GradScaler.load_state_dict`` takes any numbers, a NaN scale included)."""
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
    if not state:
        return
    checks = (("scale", lambda v: math.isfinite(v) and v > 0, "finite and > 0"),
              ("growth_factor", lambda v: math.isfinite(v) and v > 1, "finite and > 1"),
              ("backoff_factor", lambda v: 0 < v < 1, "in (0, 1)"),
              ("growth_interval", lambda v: v >= 1 and v.is_integer(), "an int >= 1"),
              ("_growth_tracker", lambda v: v >= 0 and v.is_integer(), "an int >= 0"))
    for key, ok, rule in checks:
        v = state.get(key)
        if not _is_number(v):
            raise ValueError(f"{what}[{key!r}] must be a number, got {v!r}")
        if not ok(float(v)):
            raise ValueError(f"{what}[{key!r}] must be {rule}, got {float(v)}")


#: The most values a loaded history may expand to (shared containers counted each time).
HISTORY_MAX_VALUES = 10_000_000
#: The deepest nesting of a loaded history.
HISTORY_MAX_DEPTH = 32
_HISTORY_LEAVES = (type(None), bool, int, float, str, torch.Tensor)
_JSON_KEYS = (type(None), bool, int, float, str)


def check_history(history: Any, what: str = "history") -> None:
    """ValueError unless ``history`` is what the logs can write: a list of dicts with str keys
    holding numbers, strings, None, tensors and containers of them, acyclic, at most
    HISTORY_MAX_DEPTH deep and HISTORY_MAX_VALUES values with shared containers expanded."""
    if not isinstance(history, list) or not all(
            isinstance(r, dict) and all(isinstance(k, str) for k in r) for r in history):
        raise ValueError(f"{what} must be a list of dicts with str keys (one per epoch)")
    sizes: Dict[int, int] = {}  # id -> expanded value count of a checked container
    active = set()              # the containers on the current path: meeting one is a cycle

    def walk(o, depth: int) -> int:
        if id(o) in sizes:
            return sizes[id(o)]
        if id(o) in active:
            raise ValueError(f"{what} holds itself (a cycle): the logs cannot write it")
        if depth > HISTORY_MAX_DEPTH:
            raise ValueError(f"{what} nests deeper than {HISTORY_MAX_DEPTH} levels")
        for k in o if isinstance(o, dict) else ():
            if not isinstance(k, _JSON_KEYS):
                raise ValueError(f"{what} has a key of type {type(k).__name__}, which the "
                                 "logs cannot write")
        active.add(id(o))
        total = 1
        for c in o.values() if isinstance(o, dict) else o:
            if isinstance(c, (list, tuple, dict)):
                total += walk(c, depth + 1)
            elif isinstance(c, _HISTORY_LEAVES):
                total += 1
            else:
                raise ValueError(f"{what} holds a {type(c).__name__}, which the logs cannot write")
        if total > HISTORY_MAX_VALUES:
            raise ValueError(f"{what} expands to more than {HISTORY_MAX_VALUES} values "
                             "(containers shared many times over)")
        active.discard(id(o))
        sizes[id(o)] = total
        return total

    walk(history, 0)


def save(path, state: Dict[str, Any]) -> str:
    """Write ``state`` atomically with its checksum (stale temporaries removed first)."""
    remove_stale_temps(path)
    return save_checked(state, path)


def load(path, map_location: Optional[torch.device] = None) -> Dict[str, Any]:
    """Read a Trainer checkpoint (checksum, weights-only, format); errors name the file."""
    path = os.fspath(path)
    remove_stale_temps(path)
    try:
        state = load_checked(path, map_location, what="Trainer checkpoint")
    except UncheckedFileError as exc:
        raise ValueError(f"{exc}. Trainer checkpoints of format 1 (before checksums) pickled "
                         "Python objects and cannot be read safely: start the run again") from None
    check_format(state, f"checkpoint {path!r}")
    return state


def check_format(state: Any, where: str = "checkpoint") -> None:
    """ValueError naming ``where`` unless ``state`` is a Trainer state of :data:`FORMAT`."""
    fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
    if fmt == "nnkloss.trainer/2":
        raise ValueError(f"{where} is a Trainer checkpoint of format 'nnkloss.trainer/2', which "
                         f"named the bank's centre labels 'labels'; this nnkloss reads format "
                         f"{FORMAT!r} only: start the run again")
    if fmt != FORMAT:
        raise ValueError(f"{where} is not a Trainer checkpoint of format {FORMAT!r} (found "
                         f"{fmt!r})")
