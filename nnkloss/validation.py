"""Argument checks of the whole package: clear errors that name the argument, never garbage.

Shape, dtype and device checks are free and always run. Value checks read tensor contents
(one host sync on a GPU): ``nnkloss.value_checks(False)`` switches them off; they are skipped
under ``torch.compile``. This module imports nothing of the package: the op passes its
backend's one-pass reads in as ``fused``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os

import torch

_VALUE_CHECKS = True

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "triton", "cpu", "torch")


def value_checks_enabled() -> bool:
    """Whether the data-dependent checks run now (the package's reader of the switch)."""
    return _VALUE_CHECKS


@contextlib.contextmanager
def value_checks(enabled: bool):
    """``with nnkloss.value_checks(False): ...`` runs the block without the data-dependent
    checks; the previous setting returns on exit. On by default; nestable; process-wide."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    global _VALUE_CHECKS
    old = _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS = old


# True while torch.compile traces (data-dependent checks must be skipped then): torch's own
# function, which Dynamo knows by its object; asked on every call, so not wrapped.
compiling = torch.compiler.is_compiling
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)  # private: None = unknown
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors) -> bool:
    """True outside tracing, with no dispatch mode active, for plain Tensors: where a direct
    call of a compiled routine changes nothing but the time."""
    if _dispatch_modes is None or compiling() or _dispatch_modes() != 0:
        return False
    for t in tensors:  # a loop, not all(<generator>): cheaper a call
        if type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


def require_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def require_int(name, t, ndim):
    require_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")


def as_index(t):
    """The integer tensor ``t`` as int32 / int64 (others as int64): torch indexes with a uint8
    tensor as a mask and refuses some other integer dtypes with errors that name nothing."""
    return t if t.dtype in (torch.int32, torch.int64) else t.long()


def require_float(name, t, ndim, dtypes=FLOAT_DTYPES):
    require_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def require_labelled(name, t, labels_name, labels, dtypes=FLOAT_DTYPES) -> int:
    """``t`` (n, D) float, D >= 1, with ``labels`` (n,) integer; returns n."""
    require_float(name, t, 2, dtypes)
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column (D >= 1)")
    require_int(labels_name, labels, 1)
    n = t.shape[0]
    if labels.shape[0] != n:
        raise ValueError(f"{labels_name} has length {labels.shape[0]} but {name} has {n} rows")
    return n


def require_parent_dir(name, path) -> str:
    """``path`` as a str whose directory exists, or FileNotFoundError naming ``name``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{name} {path!r}: directory {directory!r} does not exist")
    return path


def require_positive_int(name, v) -> int:
    """``v`` as an int, or ValueError naming ``name`` (bools and non-integers refused)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def maybe_nonfinite(t) -> torch.Tensor:
    """0-dim bool tensor, without a host read: False proves every value of ``t`` finite (its
    sum is); True means "perhaps not" (a sum of finite values can overflow)."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return ~torch.isfinite(t.detach().sum(dtype=acc))


def all_finite(t) -> bool:
    """Whether every value of ``t`` is finite: :func:`maybe_nonfinite`, settled elementwise
    only where it is inconclusive."""
    return not bool(maybe_nonfinite(t)) or _every_value_finite(t)


def _every_value_finite(t) -> bool:
    return bool(torch.isfinite(t.detach()).all())


def negative_or_nonfinite(w) -> torch.Tensor:
    """0-dim bool tensor, without a host read: whether ``w`` holds a negative, NaN or infinite
    value (from ``aminmax``, which propagates NaN)."""
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=w.device)
    lo, hi = torch.aminmax(w.detach())
    return ~((lo >= 0) & (hi < float("inf")))


def nonnegative_finite(w) -> bool:
    """Whether every value of ``w`` is finite and >= 0 (one host read)."""
    return not bool(negative_or_nonfinite(w))


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_batch(emb, labels, idx, centres):
    """Check a bank loss's batch (emb (B, D) float on the centres' device, labels and idx
    (B,) int); returns labels (on emb's device) and idx through :func:`as_index`."""
    # The common batch in a few reads (a training step's cost); any other takes the checks
    # below, which name what is wrong.
    if (isinstance(emb, torch.Tensor) and isinstance(labels, torch.Tensor)
            and isinstance(idx, torch.Tensor) and emb.dim() == 2 and labels.dim() == 1
            and idx.dim() == 1 and emb.dtype in FLOAT_DTYPES and labels.dtype in _INDEX_DTYPES
            and idx.dtype in _INDEX_DTYPES and not emb.is_meta):
        B, D = emb.shape
        if (labels.shape[0] == B == idx.shape[0] and centres.shape[1] == D
                and emb.device == centres.device == labels.device):
            return labels, idx
    require_float("emb", emb, 2)
    require_int("labels", labels, 1)
    require_int("idx", idx, 1)
    for name, t in (("labels", labels), ("idx", idx)):
        if t.shape[0] != emb.shape[0]:
            raise ValueError(f"{name} has length {t.shape[0]} but emb has {emb.shape[0]} rows")
    if centres.shape[1] != emb.shape[1]:
        raise ValueError(f"centres have dimension {centres.shape[1]} but emb has dimension "
                         f"{emb.shape[1]}")
    if emb.device != centres.device:
        raise ValueError(f"emb is on {emb.device} but the bank is on {centres.device}; "
                         "move all inputs to one device")
    if emb.device.type == "meta":
        raise ValueError("emb is on the meta device: a loss over a bank reads its batch's "
                         "lists and labels, which meta tensors do not hold")
    return as_index(labels).to(emb.device), as_index(idx)


def _sigma_tensor(sigma, name: str):
    """``sigma`` if it is a one-element float tensor, else the error naming ``name``."""
    if sigma.numel() != 1 or sigma.dim() > 1:
        raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape "
                         f"{tuple(sigma.shape)}")
    if not sigma.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {sigma.dtype}")
    return sigma


def require_sigma(sigma, name: str = "sigma") -> float:
    """``sigma`` (a real number or one-element tensor) as a positive finite float; TypeError
    or ValueError naming ``name``. The package's one sigma check."""
    if isinstance(sigma, torch.Tensor):
        sigma = float(_sigma_tensor(sigma, name).detach())
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"{name} must be a float or a 0-dim tensor, got {type(sigma).__name__}")
    sigma = float(sigma)
    if not (sigma > 0 and sigma < float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {sigma}")
    return sigma


def check_sigma(sigma, device):
    """Sigma for the functional op as a 0-dim tensor on ``device``; a tensor's value is left to
    :func:`check_values`."""
    if isinstance(sigma, torch.Tensor):
        _sigma_tensor(sigma, "sigma")
        if sigma.device != device:
            raise ValueError(f"sigma is on {sigma.device} but emb is on {device}")
        return sigma if sigma.dim() == 0 else sigma.reshape(())
    value = require_sigma(sigma)
    if compiling():
        # torch.full would specialise the graph on the value (a recompile per sigma).
        return torch.ones((), dtype=torch.float32, device=device).mul_(value)
    # torch.full fills on the device; torch.tensor would copy from the host (a sync).
    return torch.full((), value, dtype=torch.float32, device=device)


def check_inputs(emb, labels, centres, centre_labels, neighbours, weights, reduction, backend):
    """Shape/dtype/device checks (free: no tensor contents are read)."""
    require_float("emb", emb, 2)
    require_int("labels", labels, 1)
    require_float("centres", centres, 2)
    require_int("centre_labels", centre_labels, 1)
    require_int("neighbours", neighbours, 2)
    B, D = emb.shape
    N = centres.shape[0]
    if labels.shape[0] != B:
        raise ValueError(f"labels has length {labels.shape[0]} but emb has {B} rows")
    if centres.shape[1] != D:
        raise ValueError(f"centres have dimension {centres.shape[1]} but emb has dimension {D}")
    if centre_labels.shape[0] != N:
        raise ValueError(f"centre_labels has length {centre_labels.shape[0]} but there are {N} centres")
    if neighbours.shape[0] != B:
        raise ValueError(f"neighbours has {neighbours.shape[0]} rows but emb has {B}")
    if neighbours.shape[1] < 1:
        raise ValueError("neighbours must have at least one column (K >= 1)")
    if neighbours.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"neighbours must be int32 or int64, got {neighbours.dtype}")
    if D < 1:
        raise ValueError("emb must have at least one column (D >= 1)")
    if weights is not None:
        require_float("weights", weights, 1)
        if weights.shape[0] != N:
            raise ValueError(f"weights has length {weights.shape[0]} but there are {N} centres")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    named = [("labels", labels), ("centres", centres), ("centre_labels", centre_labels),
             ("neighbours", neighbours)] + ([("weights", weights)] if weights is not None else [])
    for name, t in named:
        if t.device != emb.device:
            raise ValueError(f"{name} is on {t.device} but emb is on {emb.device}; "
                             "move all inputs to one device")


def _gathered_rows_finite(centres, neighbours, fused=None):
    """0-dim bool: every centre row ``neighbours`` gathers is finite; reads only those rows."""
    if fused is not None and plain_eager(centres, neighbours):
        out = fused.gathered_rows_finite(centres, neighbours)
        if out is not None:
            return out
    N, D = centres.shape
    flat = neighbours.reshape(-1)
    ok = torch.ones((), dtype=torch.bool, device=centres.device)
    if N == 0 or flat.numel() == 0:
        return ok
    step = max(1, (1 << 22) // max(1, D))
    for lo in range(0, flat.numel(), step):
        idx = flat[lo:lo + step]
        rows = centres.detach()[idx.clamp(0, N - 1).long()]
        ok = ok & (torch.isfinite(rows).all(dim=1) | (idx < 0)).all()
    return ok


_CENTRES_NOT_FINITE = "centres contain NaN or inf in rows that neighbours gathers"


def defers_gathered_centres(device) -> bool:
    """Whether :func:`check_values` (with ``centres_after_op=True``) leaves the gathered
    centres to :func:`check_gathered_centres_after_op`: on CPU tensors, where reading the op's
    losses is cheaper than the gather; on a GPU it would be a second sync."""
    return torch.device(device).type == "cpu"


def check_values(emb, centres, neighbours, weights, sigma, centres_after_op=False,
                 fused=None) -> bool:
    """Data-dependent checks, one host synchronisation in all. No-op when disabled or compiling.

    Non-finite values are refused naming the argument (with the checks off they propagate as
    NaN losses). ``fused``: the op's backend, whose one-pass reads serve where they apply.
    With ``centres_after_op=True`` (ops/CONTRACT.md rule 6) CPU tensors defer the gathered
    centres to :func:`check_gathered_centres_after_op`; returns True exactly then. The index
    range is always checked before the op.
    """
    if not _VALUE_CHECKS or compiling():
        return False
    defer = bool(centres_after_op) and defers_gathered_centres(centres.device)
    N = centres.shape[0]
    flags = None if fused is None else fused.value_flags(emb, neighbours, weights)
    if flags is not None:  # CPU tensors, the compiled library loaded: one call
        lo, hi, emb_bad, weights_bad = flags
        s = float(sigma.detach())  # a CPU tensor: read, no synchronisation
        listed = neighbours.numel() > 0
        out_of_range = listed and (hi >= N or lo < -1)
        # No centre is read through an out-of-range index: that error is raised below.
        bad = [listed and hi >= N, listed and lo < -1, emb_bad, not (0 < s < float("inf")),
               not (defer or out_of_range)
               and not bool(_gathered_rows_finite(centres, neighbours, fused))]
        if weights is not None:
            bad.append(weights_bad)
    else:
        no = neighbours.new_zeros((), dtype=torch.bool)
        lo, hi = torch.aminmax(neighbours) if neighbours.numel() else (None, None)  # one pass
        flags = [
            (hi >= N) if hi is not None else no,
            (lo < -1) if lo is not None else no,
            maybe_nonfinite(emb),  # "perhaps": settled exactly below when set
            ~((sigma.detach() > 0) & (sigma.detach() < float("inf"))),  # NaN fails both
            no if defer else ~_gathered_rows_finite(centres, neighbours, fused),
        ]
        if weights is not None:
            flags.append(negative_or_nonfinite(weights.detach()))
        bad = torch.stack([f.reshape(()).to(emb.device) for f in flags]).tolist()
    if bad[0]:
        raise IndexError(f"neighbours holds index {int(hi)} but there are only "
                         f"{N} centres (valid: 0..{N - 1}, or -1 for padding)")
    if bad[1]:
        raise IndexError(f"neighbours holds index {int(lo)}; the only negative "
                         "index allowed is -1 (padding)")
    if bad[2] and not _every_value_finite(emb):
        raise ValueError("emb contains NaN or inf")
    if bad[3]:
        raise ValueError(f"sigma must be positive and finite, got {float(sigma)}")
    has_bad_weights = len(bad) > 5 and bad[5]
    # Non-finite centres are named before bad weights, deferred or not.
    if bad[4] or (defer and has_bad_weights
                  and not bool(_gathered_rows_finite(centres, neighbours, fused))):
        raise ValueError(_CENTRES_NOT_FINITE)
    if has_bad_weights:
        raise ValueError("weights must be finite and non-negative (a zero weight removes a centre)")
    return defer


def check_gathered_centres_after_op(per_row, centres, neighbours, fused=None) -> None:
    """The deferred half of :func:`check_values` (only when that returned True), given the
    op's (B,) losses or their sum or mean. Only when one is NaN are the gathered rows read:
    non-finite centres raise :func:`check_values`'s error; another cause propagates."""
    if per_row.dim() == 0:
        if not math.isnan(float(per_row.detach())):
            return
    elif not bool(torch.isnan(per_row.detach()).any()):
        return
    if not bool(_gathered_rows_finite(centres, neighbours, fused)):
        raise ValueError(_CENTRES_NOT_FINITE)
