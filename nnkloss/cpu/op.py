"""The op's passes on the CPU library, twins of ``kernels/``'s: the bank is read as it is
(fp32 / fp64 / bf16 / fp16 centres, int32 / int64 labels and lists), cheap inputs converted;
anything else runs the plain torch path, or returns None where the caller has its own.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..ops import reference
from . import build
from .build import BANK_TYPES, INDEX_TYPES, ptr

__all__ = ["forward", "centre_grad", "scale_rows", "entry_grads", "entry_grads_supported",
           "rel_sqdist", "batch_lists", "gather_lists", "gather_read", "value_flags",
           "gathered_rows_finite", "has_same_label", "forward_exp"]


def _supported(emb, centres, centre_labels, neighbours, weights) -> bool:
    # is_cpu, not device.type: no torch.device object per tensor
    return (emb.is_cpu and centres.is_cpu and centre_labels.is_cpu and neighbours.is_cpu
            and (weights is None or weights.is_cpu)
            and emb.dtype in BANK_TYPES and centres.dtype in BANK_TYPES
            and centres.is_contiguous() and centre_labels.is_contiguous()
            and centre_labels.dtype in INDEX_TYPES and neighbours.dtype in INDEX_TYPES
            and (weights is None or weights.is_floating_point())
            and emb.dim() == 2 and centres.dim() == 2 and emb.shape[1] == centres.shape[1])


# scale_rows does one multiply an element: a thread needs a far larger share to pay its start.
SCALE_MIN_ELEMS = 1 << 20


def _weights_arg(weights):
    """(weights as the library reads them, their type code): None, 0 without weights; else
    fp32 (1) or fp64 (2), other float dtypes as fp32, contiguous."""
    if weights is None:
        return None, 0
    w = weights.detach()
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    return w.contiguous(), 1 if w.dtype == torch.float32 else 2


def forward(emb, labels, centres, centre_labels, neighbours, weights, sigma, store_dist=True,
            need_grad_x=True, mean=False, lean=False):
    """The fused forward (nnkloss/ops/CONTRACT.md): the outputs of
    :func:`kernels.neighbour_kernel_fwd` for the same arguments, in one call; with ``lean``
    and without ``store_dist``, lse_all and dist are None (nothing reads them then)."""
    lib = build.lib()
    if lib is None or not _supported(emb, centres, centre_labels, neighbours, weights):
        return reference.forward(emb, labels, centres, centre_labels, neighbours, weights,
                                 sigma, store_dist, need_grad_x, mean)
    B, D = emb.shape
    K = neighbours.shape[1]
    N = centres.shape[0]
    # Read through bare pointers: shapes that disagree (a direct call of the custom op; the
    # functional op checks them) would read past the tensors.
    if (labels.shape != (B,) or neighbours.shape[0] != B or centre_labels.shape != (N,)
            or (weights is not None and weights.shape != (N,))):
        raise ValueError(_shape_error(emb, labels, centres, centre_labels, neighbours, weights))
    # Pointers only (nothing to detach); converted or copied only where the library needs it.
    f64 = emb.dtype == torch.float64
    cdt = torch.float64 if f64 else torch.float32
    x = emb if emb.dtype == cdt and emb.is_contiguous() else emb.detach().to(cdt).contiguous()
    lab = (labels if labels.dtype in INDEX_TYPES else labels.long()).contiguous()
    nb = neighbours.contiguous()
    w, wtype = _weights_arg(weights)
    new = x.new_empty
    lean = lean and not store_dist
    out = (new(B), None if lean else new(B), new(B), new(B, D if need_grad_x else 0),
           None if lean else new(B, K if store_dist else 0))
    extra = (None, None, None)
    if mean:  # counted, the mean and its divisor (empty_like: no shape to parse)
        scalar = _SCALARS[f64]
        out += (new(B, dtype=torch.bool), torch.empty_like(scalar), torch.empty_like(scalar))
        extra = (out[5].data_ptr(), out[6].data_ptr(), out[7].data_ptr())
    rc = lib.nnk_forward(
        f64, BANK_TYPES[centres.dtype], x.data_ptr(), lab.data_ptr(), lab.dtype == torch.int64,
        centres.data_ptr(), centre_labels.data_ptr(), centre_labels.dtype == torch.int64,
        nb.data_ptr(), nb.dtype == torch.int64, ptr(w), wtype, float(sigma), B, K, D, N,
        store_dist, out[0].data_ptr(), ptr(out[1]), out[2].data_ptr(),
        out[3].data_ptr() if need_grad_x else None, out[4].data_ptr() if store_dist else None,
        *extra, build.threads(B * K * D))
    if rc != 0:
        raise RuntimeError(f"nnk_forward failed (code {rc})")
    return out


_SCALARS = (torch.empty((), dtype=torch.float32), torch.empty((), dtype=torch.float64))


def _shape_error(emb, labels, centres, centre_labels, neighbours, weights) -> str:
    shapes = [("emb", emb), ("labels", labels), ("centres", centres),
              ("centre_labels", centre_labels), ("neighbours", neighbours), ("weights", weights)]
    return ("forward: shapes disagree (emb (B, D), labels (B,), centres (N, D), centre_labels "
            "(N,), neighbours (B, K), weights (N,) or None): "
            + ", ".join(f"{n} {None if t is None else tuple(t.shape)}" for n, t in shapes))


def centre_grad(emb, centres, neighbours, coef):
    """(N, D) in the compute dtype: grad[j] += coef[b, k] * (emb[b] - centres[j]) for every
    neighbours[b, k] = j >= 0 (coef already holds 1/sigma^2)."""
    lib = build.lib()
    if lib is None or not _supported(emb, centres, neighbours, neighbours, None):
        return reference.centre_grad(emb, centres, neighbours, coef.contiguous())
    cdt = reference.compute_dtype(emb)
    B, D = emb.shape
    K = neighbours.shape[1]
    N = centres.shape[0]
    if neighbours.shape[0] != B or coef.shape != neighbours.shape:  # read through pointers
        raise ValueError(f"centre_grad: neighbours {tuple(neighbours.shape)} and coef "
                         f"{tuple(coef.shape)} must both be ({B}, K) for emb {tuple(emb.shape)}")
    grad = torch.zeros(N, D, dtype=cdt)
    if B == 0 or K == 0 or N == 0:
        return grad
    x = emb.detach().to(cdt).contiguous()
    c = coef.detach().to(cdt).contiguous()
    nb = neighbours.detach().contiguous()
    rc = lib.nnk_centre_grad(
        int(cdt == torch.float64), BANK_TYPES[centres.dtype], x.data_ptr(), centres.data_ptr(),
        nb.data_ptr(), int(nb.dtype == torch.int64), c.data_ptr(), B, K, D, N, grad.data_ptr(),
        build.threads(B * K * D))
    if rc != 0:
        raise RuntimeError(f"nnk_centre_grad failed (code {rc})")
    return grad


def scale_rows(grad_x, g, lse_pos=None, divisor=None):
    """:func:`kernels.scale_rows` (its row rule and arguments) in grad_x's dtype, in one pass
    on the kernel's threads; ``g`` may be a 0-dim or expanded scalar, read as it is."""
    lib = build.lib()
    dt = grad_x.dtype
    if divisor is not None and (g.dtype != dt or divisor.dtype != dt):
        g, divisor = g / divisor, None  # torch's order: divided in g's dtype, then cast
    if g.dtype != dt:
        g = g.to(dt)
    if lse_pos is not None and (lse_pos.dtype != dt or not lse_pos.is_contiguous()):
        lse_pos = lse_pos.to(dt).contiguous()
    B = grad_x.shape[0]
    if (lib is None or not (grad_x.is_cpu and g.is_cpu) or not grad_x.is_contiguous()
            or dt not in (torch.float32, torch.float64) or g.dim() > 1
            or (g.dim() and g.shape[0] != B)
            or (lse_pos is not None and (lse_pos.dim() != 1 or lse_pos.shape[0] != B))
            or (divisor is not None and (divisor.dim() or not divisor.is_cpu))):
        return reference.scale_rows(grad_x, g, grad_x.new_zeros(()) if lse_pos is None
                                    else lse_pos, dt, divisor)
    out = torch.empty_like(grad_x)
    rc = lib.nnk_scale_rows(
        int(dt == torch.float64), grad_x.data_ptr(), g.data_ptr(), g.stride(0) if g.dim() else 0,
        ptr(divisor), ptr(lse_pos), B, grad_x.shape[1], out.data_ptr(),
        build.threads(out.numel(), SCALE_MIN_ELEMS))
    if rc != 0:
        raise RuntimeError(f"nnk_scale_rows failed (code {rc})")
    return out


def entry_grads_supported(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos,
                          g) -> bool:
    """Whether :func:`entry_grads` runs here for these tensors (metadata only: it answers for
    fake tensors too)."""
    return (build.lib() is not None and u.dtype in (torch.float32, torch.float64)
            and all(t.device.type == "cpu" for t in (u, labels, centre_labels, neighbours,
                                                      lse_all, lse_pos, g))
            and neighbours.dtype in INDEX_TYPES and labels.dtype in INDEX_TYPES
            and centre_labels.dtype in INDEX_TYPES
            and (weights is None or (weights.device.type == "cpu" and weights.dim() == 1))
            and u.dim() == 2 and u.shape == neighbours.shape and g.shape == u.shape[:1]
            # read through pointers: B labels and log-sum-exps, a weight per centre label
            and labels.shape == g.shape and lse_all.shape == g.shape
            and lse_pos.shape == g.shape and centre_labels.dim() == 1
            and (weights is None or weights.shape == centre_labels.shape))


def entry_grads(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g, sigma,
                need_coef: bool, need_q: bool, need_srow: bool):
    """The backward's per-entry terms ``(coef, q, srow)`` in one pass, as
    :func:`kernels.entry_grads` defines them (``EntryGrads`` in csrc/op.cpp); None where
    :func:`entry_grads_supported` says no."""
    if not entry_grads_supported(u, labels, centre_labels, neighbours, weights, lse_all,
                                 lse_pos, g):
        return None
    lib = build.lib()
    cdt = u.dtype
    B, K = u.shape
    w, wtype = _weights_arg(weights)
    uc = u.detach().contiguous()
    nb = neighbours.detach().contiguous()
    lab = labels.detach().contiguous()
    cl = centre_labels.detach().contiguous()
    la = lse_all.detach().to(cdt).contiguous()
    lp = lse_pos.detach().to(cdt).contiguous()
    gg = g.detach().to(cdt)
    if gg.stride(0) != 0:
        gg = gg.contiguous()
    coef = torch.empty(B, K, dtype=cdt) if need_coef else None
    q = torch.empty(B, K, dtype=cdt) if need_q and w is not None else None
    srow = torch.empty(B, dtype=cdt) if need_srow else None
    if B * K == 0:
        return tuple(None if t is None else t.zero_() for t in (coef, q, srow))
    inv = 1.0 / float(sigma)
    # An entry costs about what 16 gathered elements of the forward do.
    rc = lib.nnk_entry_grads(
        int(cdt == torch.float64), uc.data_ptr(), nb.data_ptr(), int(nb.dtype == torch.int64),
        lab.data_ptr(), int(lab.dtype == torch.int64), cl.data_ptr(),
        int(cl.dtype == torch.int64), ptr(w), wtype, la.data_ptr(), lp.data_ptr(),
        gg.data_ptr(), gg.stride(0), B, K, cl.shape[0], inv * inv, ptr(coef), ptr(q),
        ptr(srow), build.threads(B * K * 16))
    if rc != 0:
        raise RuntimeError(f"nnk_entry_grads failed (code {rc})")
    return coef, q, srow


def rel_sqdist(x, centres, idx, ref, cdt):
    """:func:`kernels.rel_sqdist` in one pass over the gathered rows. None where this is not
    done here (no library, non-CPU tensors, other dtypes, a non-contiguous bank); an index
    outside [0, N) raises IndexError."""
    lib = build.lib()
    if (lib is None or not (x.is_cpu and centres.is_cpu and idx.is_cpu and ref.is_cpu)
            or cdt not in (torch.float32, torch.float64) or centres.dtype not in BANK_TYPES
            or not centres.is_contiguous() or centres.dim() != 2 or x.dim() != 2
            or idx.dim() != 2 or x.shape[1] != centres.shape[1]
            or ref.shape != idx.shape[:1] or x.shape[0] != idx.shape[0]):
        return None
    Q, K = idx.shape
    D = x.shape[1]
    xc = x.detach().to(cdt).contiguous()
    ic = idx.detach().to(torch.int64).contiguous()
    rf = ref.detach().to(torch.int64).contiguous()
    out = torch.empty(Q, K, dtype=cdt)
    if out.numel() == 0:
        return out
    rc = lib.nnk_rel_sqdist(
        int(cdt == torch.float64), BANK_TYPES[centres.dtype], xc.data_ptr(),
        centres.data_ptr(), centres.shape[0], ic.data_ptr(), rf.data_ptr(), Q, K, D,
        out.data_ptr(), build.threads(Q * K * D))
    if rc == 3:
        raise IndexError(f"idx and ref must be bank rows in [0, {centres.shape[0]})")
    if rc != 0:
        raise RuntimeError(f"nnk_rel_sqdist failed (code {rc})")
    return out


def batch_lists(table, idx, labels, centre_labels, exclude_self: bool):
    """:func:`kernels.batch_lists` (its arguments and ``(lists, counts)``) on CPU tensors, in
    one call, its counts as host ints ``(dropped, outside)`` (read at no cost); ``labels``
    None: no label comparison (the rows dropped are those outside the bank). None where this
    is not done here: the library unavailable, other dtypes or devices."""
    lib = build.lib()
    if (lib is None or not (table.is_cpu and idx.is_cpu) or table.dtype not in INDEX_TYPES
            or table.dim() != 2 or idx.dim() != 1 or idx.dtype not in _INTEGER):
        return None
    N, K = table.shape
    B = idx.shape[0]
    lab = cl = None
    lab64 = cl64 = 0
    if labels is not None:
        if not (labels.is_cpu and centre_labels.is_cpu and labels.dtype in _INTEGER
                and centre_labels.dtype in _INTEGER and labels.shape == (B,)
                and centre_labels.shape == (N,)):
            return None
        lab, cl = _index_tensor(labels), _index_tensor(centre_labels)
        lab64, cl64 = INDEX_TYPES[lab.dtype], INDEX_TYPES[cl.dtype]
    if not table.is_contiguous():
        table = table.contiguous()
    idx = _index_tensor(idx)
    out = torch.empty(B, K, dtype=table.dtype)
    counts = (ctypes.c_int64 * 2)()
    lib.nnk_batch_lists(
        table.data_ptr(), INDEX_TYPES[table.dtype], N, K, idx.data_ptr(),
        INDEX_TYPES[idx.dtype], ptr(lab), lab64, ptr(cl), cl64, B, bool(exclude_self),
        out.data_ptr(), counts)
    return out, (counts[0], counts[1])


_INTEGER = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                      torch.uint16, torch.uint32, torch.uint64))


def _index_tensor(t):
    """An integer tensor as the library reads it: int32 / int64, contiguous (others as int64)."""
    return (t if t.dtype in INDEX_TYPES else t.long()).contiguous()


def gather_lists(table, idx, exclude_self: bool):
    """``table[idx]`` (B, K) in one pass (:func:`batch_lists` without labels); None where this is
    not done here, or for an idx outside [0, N) (the caller reports it)."""
    if (table.dtype not in INDEX_TYPES or idx.dtype not in INDEX_TYPES
            or not table.is_contiguous()):
        return None
    out = batch_lists(table, idx, None, None, exclude_self)
    if out is None or out[1][0]:  # without labels, the rows dropped are those outside the bank
        return None
    return out[0]


def gather_read(bank, neighbours, nthreads: Optional[int] = None) -> Optional[int]:
    """The benchmarks' gather limit: reads the rows of ``bank`` (N, D) that ``neighbours``
    (-1 = padding) names as the forward's first pass does, and returns the XOR of their 8-byte
    words (so the reads cannot be skipped). None where the library or the layout is missing;
    entries outside [-1, N) raise."""
    lib = build.lib()
    if (lib is None or not bank.is_cpu or not neighbours.is_cpu or bank.dim() != 2
            or not bank.is_contiguous() or neighbours.dtype not in INDEX_TYPES):
        return None
    nb = neighbours.contiguous().reshape(-1)
    if nb.numel():
        lo, hi = (int(v) for v in torch.aminmax(nb))
        if lo < -1 or hi >= bank.shape[0]:
            raise IndexError(f"neighbours must lie in [-1, {bank.shape[0]}), got [{lo}, {hi}]")
    row_bytes = bank.shape[1] * bank.element_size()
    n = torch.get_num_threads() if nthreads is None else max(1, int(nthreads))
    return int(lib.nnk_gather_read(bank.data_ptr(), bank.shape[0], row_bytes, nb.data_ptr(),
                                   int(nb.dtype == torch.int64), nb.numel(), n))


def value_flags(emb, neighbours, weights):
    """The value checks' reads in one call: ``(lo, hi, emb_bad, weights_bad)``, the smallest and
    largest list entry (0, 0 for none), whether emb holds a NaN or inf, whether weights hold a
    negative value, NaN or inf. None where the library is not loaded yet (a check never builds
    it) or the tensors are not ones it reads."""
    lib = build._state["lib"]
    if (lib is None or not emb.is_cpu or not neighbours.is_cpu
            or emb.dtype not in BANK_TYPES or neighbours.dtype not in INDEX_TYPES
            or not emb.is_contiguous() or not neighbours.is_contiguous()
            or (weights is not None and (not weights.is_cpu or weights.dtype not in BANK_TYPES
                                         or not weights.is_contiguous()))):
        return None
    out = (ctypes.c_int64 * 4)()
    rc = lib.nnk_check_values(
        neighbours.data_ptr(), int(neighbours.dtype == torch.int64), neighbours.numel(),
        emb.data_ptr(), BANK_TYPES[emb.dtype], emb.numel(), ptr(weights),
        BANK_TYPES[weights.dtype] if weights is not None else 0,
        0 if weights is None else weights.numel(), out)
    if rc != 0:
        raise RuntimeError(f"nnk_check_values failed (code {rc})")
    return out[0], out[1], bool(out[2]), bool(out[3])


def gathered_rows_finite(centres, neighbours):
    """:func:`kernels.gathered_rows_finite` in one pass; None as for :func:`value_flags`."""
    lib = build._state["lib"]
    if (lib is None or not (centres.is_cpu and neighbours.is_cpu) or centres.dim() != 2
            or centres.dtype not in BANK_TYPES or neighbours.dtype not in INDEX_TYPES
            or not centres.is_contiguous()):
        return None
    N, D = centres.shape
    flat = neighbours.detach().reshape(-1).contiguous()
    n = flat.numel()
    if n == 0 or N == 0 or D == 0:
        return torch.ones((), dtype=torch.bool)
    rc = lib.nnk_gathered_finite(
        centres.data_ptr(), BANK_TYPES[centres.dtype], N, D, flat.data_ptr(),
        INDEX_TYPES[flat.dtype], n, build.threads(n * D))
    if rc not in (0, 1):
        raise RuntimeError(f"nnk_gathered_finite failed (code {rc})")
    return torch.tensor(rc == 0)


def has_same_label(neighbours, centre_labels):
    """(N,) bool: list i of ``neighbours`` (N, K), -1 = padding, holds a row of label
    ``centre_labels[i]``. None where this is not done here (no library, tensors it does not
    read); an entry read outside [-1, N) raises IndexError."""
    lib = build.lib()
    if (lib is None or not (neighbours.is_cpu and centre_labels.is_cpu)
            or neighbours.dtype not in INDEX_TYPES or centre_labels.dtype not in INDEX_TYPES
            or neighbours.dim() != 2 or centre_labels.dim() != 1
            or neighbours.shape[0] != centre_labels.shape[0]
            or not (neighbours.is_contiguous() and centre_labels.is_contiguous())):
        return None
    N, K = neighbours.shape
    out = torch.empty(N, dtype=torch.bool)
    rc = lib.nnk_has_same_label(neighbours.data_ptr(), INDEX_TYPES[neighbours.dtype], N, K,
                                centre_labels.data_ptr(), INDEX_TYPES[centre_labels.dtype],
                                out.data_ptr())
    if rc == 3:
        raise IndexError(f"neighbours must hold rows in [0, {N}) or -1 (padding)")
    if rc != 0:
        raise RuntimeError(f"nnk_has_same_label failed (code {rc})")
    return out


def forward_exp(x):
    """The compiled forward's exponential (``vexp``) applied to an fp32 CPU tensor, for tests;
    None when the library is unavailable."""
    lib = build.lib()
    if lib is None:
        return None
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty_like(x)
    lib.nnk_vexp(x.data_ptr(), out.data_ptr(), x.numel())
    return out


