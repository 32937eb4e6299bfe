"""The public k-nearest-neighbour search: :func:`knn` (whole result), :func:`iter_knn` (the
same result block by block, for callers that reduce it as it comes, like the metrics), their
argument checks, and :func:`recall_against_exact` for approximate indexes."""
from __future__ import annotations

import math
import numbers
from typing import Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...validation import FLOAT_DTYPES, require_float, require_positive_int
from .exclusion import drop_self
from .faiss_search import (build_approximate, build_flat, check_index_options,
                           iter_search_index, require_faiss, search_index)
from .torch_search import decoded_into, iter_knn_torch, same_tensor

__all__ = ["knn", "iter_knn", "check_search_arguments", "resolve_search_backend",
           "SearchResult", "SearchBlock", "recall_against_exact", "SEARCH_BACKENDS",
           "APPROXIMATE", "check_search_backend", "check_finite", "validate"]

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
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n - int(exclude_self):
        what = (f"the base has {n} rows and exclude_self leaves {n - 1} per query"
                if exclude_self else f"the base has only {n} rows")
        raise ValueError(f"k={k} is larger than the number of candidates: {what}")
    check_finite("queries", queries)
    if base is not queries:
        check_finite("base", base)
    return k


class SearchResult(NamedTuple):
    """What :func:`knn` returns, both (Q, k) nearest first: fp32 squared L2 ``distances`` and
    int64 base rows ``neighbours`` (inf / -1: a neighbour an approximate search missed)."""
    distances: Tensor
    neighbours: Tensor


class SearchBlock(NamedTuple):
    """One block of :func:`iter_knn`: the results of query rows ``row0 .. row0 + rows - 1``."""
    row0: int
    distances: Tensor
    neighbours: Tensor


def resolve_search_backend(search_backend: str, device: Optional[torch.device] = None) -> str:
    """The search a ``search_backend`` runs on any ``device``: "auto" is "torch" (never
    dependent on faiss)."""
    return "torch" if check_search_backend(search_backend) == "auto" else search_backend


def iter_knn(queries: Tensor, base: Tensor, k: int, search_backend: str = "auto",
             exclude_self: bool = False, *, tile_bytes: Optional[int] = None
             ) -> Iterator[SearchBlock]:
    """Exact search as :func:`knn`, yielded as :class:`SearchBlock` per block of query rows;
    memory: one block's working set. Arguments are checked at the call."""
    check_search_backend(search_backend)
    k = validate(queries, base, k, exclude_self)
    return _iter_checked(queries, base, k, search_backend, exclude_self, tile_bytes)


def _iter_checked(queries: Tensor, base: Tensor, k: int, search_backend: str,
                  exclude_self: bool, tile_bytes: Optional[int],
                  out: Optional[Tuple[Tensor, Tensor]] = None, approximate: Optional[str] = None,
                  index_options: Optional[dict] = None) -> Iterator[SearchBlock]:
    if queries.shape[0] == 0:
        return
    kk = k + int(exclude_self)  # faiss: the own row is searched for, then dropped below
    if approximate is not None:
        blocks = iter_search_index(build_approximate(base, approximate, k, **index_options),
                                   queries, kk)
    elif resolve_search_backend(search_backend) == "faiss":
        blocks = iter_search_index(build_flat(base, kk), queries, kk)
    else:
        for block in iter_knn_torch(queries, base, k, tile_bytes,
                                    self_search=same_tensor(queries, base),
                                    exclude_self=exclude_self, out=out):
            yield SearchBlock(*block)
        return
    for q0, dist, idx in blocks:
        if exclude_self:
            own = torch.arange(q0, q0 + idx.shape[0], device=idx.device)
            dist, idx = drop_self(dist, idx, own, k)
        yield SearchBlock(q0, dist, idx)


def check_search_arguments(search_backend, approximate, options: dict, arg: str = "{}") -> None:
    """:func:`knn`'s checks of backend, index kind, index options and faiss (ImportError),
    before any work; ``arg`` spells an option's name as the caller passed it."""
    if approximate not in APPROXIMATE:
        raise ValueError(f"{arg.format('approximate')} must be one of {APPROXIMATE}, got "
                         f"{approximate!r}")
    check_search_backend(search_backend)
    check_index_options(approximate, options, arg)
    if approximate is not None:
        asked = f"{arg.format('approximate')}={approximate!r}"
        if search_backend not in ("auto", "faiss"):
            raise ValueError(f"{asked} uses faiss indexes; search_backend must be 'auto' or "
                             f"'faiss', got {search_backend!r}")
        require_faiss(asked)


def knn(queries: Tensor, base: Tensor, k: int, search_backend: str = "auto",
        exclude_self: bool = False, approximate: Optional[str] = None, *,
        tile_bytes: Optional[int] = None, nlist: Optional[int] = None,
        nprobe: Optional[int] = None, hnsw_m: Optional[int] = None,
        ef_construction: Optional[int] = None, ef_search: Optional[int] = None,
        train_size: Optional[int] = None, seed: Optional[int] = None) -> SearchResult:
    """The ``k`` nearest base rows of every query row, by squared Euclidean distance.

    Args:
        queries, base: (Q, D) and (N, D) float tensors on one device (distances in fp32).
        k: neighbours per query, ``1 <= k <= N`` (``<= N - 1`` with ``exclude_self``).
        search_backend: "torch" (tiled GEMM, any device), "faiss" (exact ``IndexFlatL2``) or
            "auto" (= "torch").
        exclude_self: the queries are the base rows (Q == N) and row i never returns i
            (duplicates still do). Pass one tensor as both for the faster self-search.
        approximate: None (exact), "ivf" (faiss ``IndexIVFFlat``) or "hnsw" (faiss
            ``IndexHNSWFlat``, CPU), with ``search_backend`` "auto" or "faiss".
        tile_bytes: the torch search's working memory (default: 256 MiB on the CPU, a quarter
            of the free memory on CUDA, at most 4 GiB).
        nlist, nprobe, train_size: IVF lists (default ~4 sqrt(N)), lists probed (default
            max(8, nlist/8)), training sample (default 256 nlist).
        hnsw_m, ef_construction, ef_search: HNSW degree, build and search beams (defaults
            32, 64, 64; the search beam at least 2k + 2).
        seed: of the IVF training sample and k-means (default 0).
        An index option of another index is a ValueError naming it.

    Returns:
        :class:`SearchResult` on the queries' device, ties ordered by index (on CUDA "torch"
        follows PyTorch's TF32 setting).

    Raises ValueError / TypeError naming the argument at fault (NaN/inf or a row norm above
    2**62 included), ImportError where faiss is needed but missing, all before any work.
    Empty queries give (0, k) results. The torch search never forms a Q x N matrix.
    """
    options = {"nlist": nlist, "nprobe": nprobe, "train_size": train_size, "seed": seed,
               "hnsw_m": hnsw_m, "ef_construction": ef_construction, "ef_search": ef_search}
    check_search_arguments(search_backend, approximate, options)
    k = validate(queries, base, k, exclude_self)
    q = queries.shape[0]
    out = (torch.empty(q, k, dtype=torch.float32, device=queries.device),
           torch.empty(q, k, dtype=torch.long, device=queries.device))
    # The compiled selection decodes straight into ``out``; other blocks are copied in.
    for q0, dist, idx in _iter_checked(queries, base, k, search_backend, exclude_self,
                                       tile_bytes, out, approximate, options):
        if not decoded_into(out, q0, dist, idx):
            out[0][q0:q0 + dist.shape[0]] = dist
            out[1][q0:q0 + idx.shape[0]] = idx
    return SearchResult(*out)


_RECALL_PARAMS = {"nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "train_size",
                  "tile_bytes"}


def recall_against_exact(queries: Tensor, base: Tensor, k: int, approximate: str = "ivf",
                         sample: int = 1000, exclude_self: bool = False, seed: int = 0,
                         exact_search_backend: str = "auto", **params) -> float:
    """Recall@k of an approximate index against exact search, on a random sample of queries.

    The mean over ``min(sample, Q)`` random queries of the share of the k found that are as
    close as the exact k-th neighbour (ties not penalised). ``params``: :func:`knn`'s index
    options and ``tile_bytes``; ``seed`` picks the sample and seeds IVF's training.
    """
    if approximate not in ("ivf", "hnsw"):
        raise ValueError(f"approximate must be 'ivf' or 'hnsw', got {approximate!r}")
    sample = require_positive_int("sample", sample)
    unknown = set(params) - _RECALL_PARAMS
    if unknown:
        raise TypeError(f"recall_against_exact got unknown parameters {sorted(unknown)}; "
                        f"accepted: {sorted(_RECALL_PARAMS)}")
    check_search_arguments("auto", approximate, params)
    k = validate(queries, base, k, exclude_self)
    q = queries.shape[0]
    if q == 0:
        raise ValueError("queries is empty: there is nothing to measure recall on")
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(q, generator=g)[:min(int(sample), q)].sort().values.to(queries.device)
    sub = queries[rows]
    kk = k + int(exclude_self)
    options = {name: v for name, v in params.items() if name != "tile_bytes"}
    if approximate == "ivf":
        options["seed"] = seed
    index = build_approximate(base, approximate, k, **options)
    a_d, a_i = search_index(index, sub, min(kk, base.shape[0]))
    e_d, e_i = knn(sub, base, kk, exact_search_backend, tile_bytes=params.get("tile_bytes"))
    if exclude_self:
        a_d, a_i = drop_self(a_d, a_i, rows, k)
        e_d, e_i = drop_self(e_d, e_i, rows, k)
    kth = e_d[:, -1:].float()
    # Same fp32 expansion on both sides; a small relative slack absorbs rounding differences.
    hit = (a_i >= 0) & (a_d <= kth * (1 + 1e-5) + 1e-6)
    return float(hit.sum(1).clamp_max(k).float().mean() / k)
