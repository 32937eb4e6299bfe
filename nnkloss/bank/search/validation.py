"""Argument checks shared by every search entry point (exact, approximate, lists, recall)."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ...validation import FLOAT_DTYPES, require_float
from .faiss_search import require_faiss

__all__ = ["SEARCH_BACKENDS", "APPROXIMATE", "check_search_backend", "check_k", "check_finite",
           "validate"]

# The neighbour-search implementations ("auto" resolves to one of the others).
SEARCH_BACKENDS = ("auto", "torch", "faiss")
APPROXIMATE = (None, "ivf", "hnsw")


def check_search_backend(search_backend) -> str:
    """``search_backend`` if it can run here (ImportError for "faiss" without faiss)."""
    if search_backend not in SEARCH_BACKENDS:
        raise ValueError(f"search_backend must be one of {SEARCH_BACKENDS}, "
                         f"got {search_backend!r}")
    if search_backend == "faiss":
        require_faiss("search_backend='faiss'")
    return search_backend


def check_k(k, available: int, exclude_self: bool) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > available:
        what = (f"the base has {available + 1} rows and exclude_self leaves {available} per query"
                if exclude_self else f"the base has only {available} rows")
        raise ValueError(f"k={k} is larger than the number of candidates: {what}")
    return k


# Largest row norm a search accepts: the fp32 partial sums of ||q||^2 - 2 q.b + ||b||^2 then
# stay under 2**126.
MAX_ROW_NORM = 2.0 ** 62


def check_finite(name: str, t: Tensor) -> None:
    """NaN / inf, or rows whose squared distances would overflow fp32 (norm > MAX_ROW_NORM)."""
    if t.numel() == 0:
        return
    # One pass where all is well (row norm <= sqrt(D) max |value|; NaN fails the test).
    lo, hi = torch.aminmax(t.detach())
    top = float(torch.maximum(-lo, hi))  # one read back, not two
    if top * math.sqrt(t.shape[1]) <= MAX_ROW_NORM:
        return
    if not bool(torch.isfinite(t.detach()).all()):
        bad = int((~torch.isfinite(t)).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"{name} contains NaN or inf (first bad row: {bad})")
    norms = torch.linalg.vector_norm(t.detach().double() / top, dim=1) * top
    if bool((norms > MAX_ROW_NORM).any()):
        bad = int((norms > MAX_ROW_NORM).nonzero()[0, 0])
        raise ValueError(f"{name} has a row of norm {float(norms[bad]):.3g} (first such row: "
                         f"{bad}): its squared distances would overflow fp32, in which the "
                         f"search computes them; rows must have norm <= 2**62 (rescale)")


def validate(queries: Tensor, base: Tensor, k, exclude_self: bool) -> int:
    """Check a (queries, base, k) search request; returns k as an int."""
    require_float("queries", queries, 2, FLOAT_DTYPES)
    require_float("base", base, 2, FLOAT_DTYPES)
    if queries.shape[1] != base.shape[1]:
        raise ValueError(f"queries have dimension {queries.shape[1]} but base has "
                         f"dimension {base.shape[1]}")
    if queries.shape[1] == 0:
        raise ValueError("queries and base must have at least one column (D >= 1)")
    if queries.device != base.device:
        raise ValueError(f"queries are on {queries.device} but base is on {base.device}")
    n = base.shape[0]
    if n == 0:
        raise ValueError("base is empty: there is nothing to search")
    if exclude_self and queries.shape[0] != n:
        raise ValueError(f"exclude_self=True means the queries are the base rows, but queries "
                         f"has {queries.shape[0]} rows and base has {n}")
    k = check_k(k, n - 1 if exclude_self else n, exclude_self)
    check_finite("queries", queries)
    if base is not queries:
        check_finite("base", base)
    return k
