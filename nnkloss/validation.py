"""Argument checks of the whole package: clear errors that name the argument, never garbage.

Shape, dtype and device checks cost nothing and always run. Value checks (index range,
negative weights, sigma <= 0, non-finite embeddings and gathered centres, a batch's labels
against its bank rows) read tensor contents; on a GPU that is one host synchronisation, so a
hot loop can switch them off for a block with the one public switch, the context manager
``nnkloss.value_checks(False)`` (the bank is validated whenever it is written, so a loss over a
bank loses little). :func:`value_checks_enabled` is the package's reader of that switch. They
are skipped under ``torch.compile``.

The gathered centres of the functional op, on CPU tensors, are checked after the op rather than
before it (:func:`check_values` with ``centres_after_op=True``, then
:func:`check_gathered_centres_after_op`): reading every gathered row (B x K x D values) only to
see that it is finite cost an order of magnitude more than the op itself on the CPU, and the
op already marks each row that gathers a non-finite centre value with a NaN loss
(ops/CONTRACT.md, rule 6). So the rows are read only when some row came out NaN, to tell a
non-finite centre (raised, naming ``centres``, as before) from an fp32 overflow (not an error:
the NaN propagates; such a call pays the read, as every checked call did before). On a GPU the
gathered rows are still checked before the op, in the one host synchronisation of the checks:
there the read is asynchronous device work, while the check after the op would be a second
synchronisation per checked call (see :func:`defers_gathered_centres`). Either way the same
call raises the same error. The CCML loss keeps the check before the loss on every device: it
does not follow rule 6 (see :mod:`nnkloss.losses.ccml`).

Sigma is checked in one place, :func:`require_sigma` (a positive finite float);
:func:`check_sigma` builds on it for the functional op, which also takes a 0-dim tensor.
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
    checks (no host synchronisation for them on a GPU); the previous setting comes back on
    exit, exceptions included. On by default. Nestable; not thread-local (one switch for the
    process, as a hot loop wants)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    global _VALUE_CHECKS
    old = _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS = old


# Looked up once: the op's every call asks (two getattr a call were ~0.2 us of its ~20 us of
# Python at B 1; Dynamo knows the function by its object, however it is reached).
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)  # private: None = unknown
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def compiling() -> bool:
    """True while torch.compile traces (data-dependent checks must be skipped then)."""
    return _is_compiling is not None and bool(_is_compiling())


def plain_eager(*tensors) -> bool:
    """True outside torch.compile / export tracing, with no dispatch mode active (fake
    tensors, FlopCounterMode, ...), for tensors of the plain Tensor type: where calling a
    compiled CPU routine directly, instead of a custom op or torch's own ops, changes nothing
    but the time."""
    if _dispatch_modes is None or compiling() or _dispatch_modes() != 0:
        return False
    for t in tensors:  # a loop, not all(<generator>): ~0.5 us less a call
        if type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def require_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def require_int(name, t, ndim):
    require_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not is_integer_dtype(t.dtype):
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")


def as_index(t):
    """The integer tensor ``t`` (already checked by :func:`require_int`: an index or labels)
    as torch indexes and compares with: int32 / int64 as it is, other integer dtypes as int64.
    Indexing reads a uint8 tensor as a boolean mask (other rows, silently) and refuses int8 /
    int16, and comparisons refuse to promote uint16 / uint32 / uint64 against int32 / int64,
    with errors that name no argument."""
    return t if t.dtype in (torch.int32, torch.int64) else t.long()


def require_float(name, t, ndim, dtypes=FLOAT_DTYPES):
    require_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def require_labelled(name, t, labels_name, labels, dtypes=FLOAT_DTYPES) -> int:
    """``t`` (n, D) float, D >= 1, with ``labels`` (n,) integer, one label per row; returns
    n. (With D = 0 every distance is 0 and every neighbour a tie: nothing to search.)"""
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
    """0-dim bool tensor on t's device, without a host read: False proves every value of the
    float tensor ``t`` finite; True means "perhaps not" (ask :func:`all_finite`).

    It is the sum, accumulated in fp32 (fp64 for fp64), that is tested: any NaN or inf makes an
    IEEE sum NaN or inf, so a finite sum proves them absent. A sum can also overflow with
    finite values (|values| near the dtype's maximum), hence "perhaps". One vectorised read
    instead of ``isfinite(t).all()``'s elementwise pass and bool tensor: on the 2-core CPU,
    1024 x 128 fp32, 4.5 against 96 us (measured 2026-11-24)."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return ~torch.isfinite(t.detach().sum(dtype=acc))


def all_finite(t) -> bool:
    """Whether every value of the float tensor ``t`` is finite (one host read): the sum's test
    of :func:`maybe_nonfinite`, and the exact elementwise test only where that is inconclusive
    (a non-finite value, or a finite sum that overflowed)."""
    return not bool(maybe_nonfinite(t)) or _every_value_finite(t)


def _every_value_finite(t) -> bool:
    """The exact elementwise test (one host read): where the sum's test is inconclusive."""
    return bool(torch.isfinite(t.detach()).all())


def negative_or_nonfinite(w) -> torch.Tensor:
    """0-dim bool tensor, without a host read: whether the float tensor ``w`` holds a negative,
    NaN or infinite value. Exact, from its minimum and maximum in one pass (``aminmax``
    propagates NaN, which fails both comparisons): on the 2-core CPU, 50,000 fp32, 5 against
    62 us for ``(w < 0).any() | ~isfinite(w).all()`` (measured 2026-11-24)."""
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=w.device)
    lo, hi = torch.aminmax(w.detach())
    return ~((lo >= 0) & (hi < float("inf")))


def nonnegative_finite(w) -> bool:
    """Whether every value of the float tensor ``w`` is finite and >= 0 (one host read)."""
    return not bool(negative_or_nonfinite(w))


def check_batch(emb, labels, idx):
    """The batch of a loss over a bank: emb (B, D) float, labels (B,) int, idx (B,) int rows."""
    require_float("emb", emb, 2)
    require_int("labels", labels, 1)
    require_int("idx", idx, 1)
    for name, t in (("labels", labels), ("idx", idx)):
        if t.shape[0] != emb.shape[0]:
            raise ValueError(f"{name} has length {t.shape[0]} but emb has {emb.shape[0]} rows")


def require_sigma(sigma, name: str = "sigma") -> float:
    """``sigma`` as a positive finite float: the package's one sigma check.

    Takes a real number or a one-element tensor (read once: a host sync on GPU). Raises
    TypeError for anything else (bools and strings included) and ValueError for <= 0, inf or
    NaN, naming ``name``."""
    if isinstance(sigma, torch.Tensor):
        if sigma.numel() != 1 or sigma.dim() > 1:
            raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape "
                             f"{tuple(sigma.shape)}")
        if not sigma.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {sigma.dtype}")
        sigma = float(sigma.detach())
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"{name} must be a float or a 0-dim tensor, got {type(sigma).__name__}")
    sigma = float(sigma)
    if not (sigma > 0 and sigma < float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {sigma}")
    return sigma


def check_sigma(sigma, device):
    """Sigma for the functional op: a 0-dim tensor on ``device``. A float is checked by
    :func:`require_sigma`; a tensor's shape, dtype and device are checked here (free) and its
    value by :func:`check_values` (with the other value checks, one sync)."""
    if isinstance(sigma, torch.Tensor):
        if sigma.numel() != 1 or sigma.dim() > 1:
            raise ValueError(f"sigma must be a float or a 0-dim tensor, got shape {tuple(sigma.shape)}")
        if not sigma.dtype.is_floating_point:
            raise TypeError(f"sigma must be a floating-point tensor, got {sigma.dtype}")
        if sigma.device != device:
            raise ValueError(f"sigma is on {sigma.device} but emb is on {device}")
        return sigma if sigma.dim() == 0 else sigma.reshape(())
    value = require_sigma(sigma)
    if compiling():
        # Traced, torch.full (and torch.tensor) specialise the graph on the float's value:
        # under aot_eager / inductor a new sigma each call (a schedule) recompiled every time,
        # then ran eagerly past the recompile limit. A product with it keeps it symbolic.
        return torch.ones((), dtype=torch.float32, device=device).mul_(value)
    # torch.full fills on the device: torch.tensor(float, device="cuda") is a copy from host
    # memory, which waits for the stream (a host sync on every call of the functional op)
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


def _gathered_rows_finite(centres, neighbours):
    """0-dim bool: every centre row that ``neighbours`` gathers is finite. Reads only those
    rows (O(B*K*D)), never the whole (N, D) bank: in one pass over them on CPU and CUDA
    tensors (:func:`_fused_gathered_rows_finite`), elsewhere torch gathers in chunks of
    bounded size."""
    fused = _fused_gathered_rows_finite(centres, neighbours)
    if fused is not None:
        return fused
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


def _fused_gathered_rows_finite(centres, neighbours):
    """One pass over the listed rows, or None: on CPU tensors the compiled library's
    (:func:`nnkloss.ops.cpu.gathered_rows_finite`; 3.5 against 46-103 ms for torch's form at
    B 256, K 100, D 512, fp32, 2 threads, 2026-11-26), on CUDA tensors the Triton kernel's
    (triton installed): :func:`nnkloss.ops.backends.fused_pass`; neither when traced. Imported
    here, not at the top: the ops layer sits below this module."""
    if not plain_eager(centres, neighbours):
        return None
    if centres.device.type == "cpu" and not _COMPILED_CHECKS:  # the tests' switch to torch's
        return None
    from .ops.backends import fused_pass
    impl = fused_pass(centres.device)
    return None if impl is None else impl.gathered_rows_finite(centres.detach(), neighbours)


def defers_gathered_centres(device) -> bool:
    """Whether :func:`check_values` (asked with ``centres_after_op=True``) leaves the gathered
    centres to :func:`check_gathered_centres_after_op`: on CPU tensors only.

    On the CPU the op has finished when it returns, so reading its (B,) losses afterwards
    costs one reduction, while the B x K x D read cost an order of magnitude more than the op
    (B 256, K 100, D 512, fp32 bank, 2 cores: ~37 ms against ~1.7 ms). On a GPU (any other
    device) the read before the op is queued device work whose result joins the one host
    synchronisation the checks make anyway; a check after the op would be a second one per
    checked call, stalling the host until the op has run instead of letting it queue the
    backward. Which costs a training step more there has not been measured, so the GPU keeps
    the documented one synchronisation."""
    return torch.device(device).type == "cpu"


def check_values(emb, centres, neighbours, weights, sigma, centres_after_op=False) -> bool:
    """Data-dependent checks, one host synchronisation in all. No-op when disabled or compiling.

    Non-finite values are refused, naming the argument (centres: only the gathered rows are
    read). With the checks off they propagate instead: the rows they touch get a NaN loss.

    ``centres_after_op=True`` (the caller's op follows ops/CONTRACT.md rule 6: a row that
    gathers a non-finite centre value gets a NaN loss) lets CPU tensors skip the read of the
    gathered centres here (see :func:`defers_gathered_centres`); the caller must then pass the
    op's (B,) losses to :func:`check_gathered_centres_after_op`, which raises the same error.
    Returns True exactly when it did so (checks on, not compiling, CPU tensors). The index
    range, ``emb``, ``sigma`` and ``weights`` are always checked here, before the op (an index
    out of range must never reach a kernel).
    """
    if not _VALUE_CHECKS or compiling():
        return False
    defer = bool(centres_after_op) and defers_gathered_centres(centres.device)
    N = centres.shape[0]
    compiled = _compiled_value_flags(emb, neighbours, weights)
    if compiled is not None:  # CPU tensors, the compiled kernel already loaded: one call
        lo, hi, emb_bad, weights_bad = compiled
        s = float(sigma.detach())  # a CPU tensor: read, no synchronisation
        listed = neighbours.numel() > 0
        out_of_range = listed and (hi >= N or lo < -1)
        # No centre row is read through a list that holds an index outside the bank: that
        # error is raised below, naming the index.
        bad = [listed and hi >= N, listed and lo < -1, emb_bad, not (0 < s < float("inf")),
               not (defer or out_of_range)
               and not bool(_gathered_rows_finite(centres, neighbours))]
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
            no if defer else ~_gathered_rows_finite(centres, neighbours),
        ]
        if weights is not None:
            wd = weights.detach()
            flags.append(negative_or_nonfinite(wd))
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
    # Deferred or not, non-finite centres are named before bad weights, as they always were:
    # on that (failing) path the gathered rows are read here after all.
    if bad[4] or (defer and has_bad_weights
                  and not bool(_gathered_rows_finite(centres, neighbours))):
        raise ValueError(_CENTRES_NOT_FINITE)
    if has_bad_weights:
        raise ValueError("weights must be finite and non-negative (a zero weight removes a centre)")
    return defer


def _compiled_value_flags(emb, neighbours, weights):
    """``(lo, hi, emb_bad, weights_bad)`` of :func:`check_values` from the compiled CPU
    kernel in one call (:func:`nnkloss.ops.cpu.value_flags`: the list entries' range, a NaN/inf
    in emb, a negative or non-finite weight), or None: not CPU tensors, the library not loaded
    (a value check never builds it), or inputs it does not take. Same answers as the torch
    reductions below it (tests/test_validation.py runs the check tests on both)."""
    if not _COMPILED_CHECKS:
        return None
    from . import cpu
    return cpu.value_flags(emb, neighbours, weights)


# Off: check_values always takes the torch path (tests compare the two).
_COMPILED_CHECKS = True


def check_gathered_centres_after_op(per_row, centres, neighbours) -> None:
    """The deferred half of :func:`check_values` (call it only when that returned True), with
    the op's (B,) per-row losses, or their 0-dim sum or mean. Rule 6 of ops/CONTRACT.md makes
    every row that gathers a non-finite centre value NaN, so when no row is NaN (one reduction
    of B numbers) no centre is read. A finite row's loss is finite and >= 0, so the sum and
    the mean are NaN exactly when a row is: given one, this reads one number (a reduction and
    a test of the (B,) losses cost ~20 us after the forward's kernel has swept the caches, at
    B 1024 on the 2-core Intel Xeon, 2026-11-27). Otherwise the gathered rows are read to find
    the cause: non-finite centres raise the ValueError :func:`check_values` raises for them;
    any other cause (a scaled distance beyond fp32, which rule 6 also turns into a NaN row) is
    not an error: the NaN propagates, as with the checks off."""
    if per_row.dim() == 0:
        if not math.isnan(float(per_row.detach())):
            return
    elif not bool(torch.isnan(per_row.detach()).any()):
        return
    if not bool(_gathered_rows_finite(centres, neighbours)):
        raise ValueError(_CENTRES_NOT_FINITE)
