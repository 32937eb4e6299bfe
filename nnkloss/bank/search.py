"""k-nearest-neighbour search for building the centres' neighbour lists (and for classifying).

Two exact backends and two approximate indexes:

* ``"torch"``: tiled ``||q||^2 - 2 q.b + ||b||^2`` matmuls with a running top-k merge over base
  tiles. Runs on any device; memory is bounded by the tile budget (never a Q x N matrix).
* ``"faiss"``: ``IndexFlatL2`` (exact); on a GPU when the inputs are CUDA tensors and the installed
  faiss has working GPU support, otherwise on the CPU. faiss is an optional dependency.
* ``approximate="ivf"`` / ``"hnsw"``: faiss ``IndexIVFFlat`` / ``IndexHNSWFlat`` for large N, with
  :func:`recall_against_exact` to measure what the approximation loses.

All results are squared L2 distances in ascending order (fp32) and int64 base-row indices.
"""
from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..validation import (FLOAT_DTYPES, require_float, require_labelled,
                          require_positive_int)

__all__ = ["knn", "recall_against_exact", "neighbour_lists", "NeighbourLists",
           "faiss_available", "faiss_gpu_usable", "KNN_BACKENDS", "APPROXIMATE"]

KNN_BACKENDS = ("auto", "torch", "faiss")
APPROXIMATE = (None, "ivf", "hnsw")

# Working-memory budget of the torch backend on the CPU (distance tile + top-k temporaries).
_CPU_TILE_BYTES = 256 * 2**20
# On CUDA the budget is this share of the free memory, capped (bigger tiles stop paying off).
_CUDA_FREE_SHARE = 0.25
_CUDA_TILE_BYTES_MAX = 4 * 2**30


# ============================================================================ validation
def _check_k(k, available: int, exclude_self: bool) -> int:
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


def _check_finite(name: str, t: Tensor) -> None:
    # One host synchronisation per argument: knn is a per-refresh call, not a per-step one.
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"{name} contains NaN or inf (first bad row: {bad})")


def _validate(queries: Tensor, base: Tensor, k, exclude_self: bool) -> int:
    require_float("queries", queries, 2, FLOAT_DTYPES)
    require_float("base", base, 2, FLOAT_DTYPES)
    if queries.shape[1] != base.shape[1]:
        raise ValueError(f"queries have dimension {queries.shape[1]} but base has "
                         f"dimension {base.shape[1]}")
    if queries.device != base.device:
        raise ValueError(f"queries are on {queries.device} but base is on {base.device}")
    n = base.shape[0]
    if n == 0:
        raise ValueError("base is empty: there is nothing to search")
    if exclude_self and queries.shape[0] != n:
        raise ValueError(f"exclude_self=True means the queries are the base rows, but queries "
                         f"has {queries.shape[0]} rows and base has {n}")
    k = _check_k(k, n - 1 if exclude_self else n, exclude_self)
    _check_finite("queries", queries)
    if base is not queries:
        _check_finite("base", base)
    return k


# ============================================================================ torch backend
def _tile_budget(device: torch.device, tile_bytes: Optional[int]) -> int:
    if tile_bytes is not None:
        return max(int(tile_bytes), 1)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(max(free * _CUDA_FREE_SHARE, 32 * 2**20), _CUDA_TILE_BYTES_MAX))
    return _CPU_TILE_BYTES


def _tile_sizes(q: int, n: int, d: int, k: int, budget: int) -> Tuple[int, int]:
    """(query rows, base rows) per tile so that the fp32 working set fits in ``budget`` bytes.

    Per tile: the (tq, tb) distance tile and one top-k temporary of the same order (2 x 4 bytes
    per entry), the fp32 copies of both operand tiles, and the (tq, 2k) merge buffers.
    """
    tq = max(1, min(q, 4096))
    while True:
        rest = budget - tq * (d * 4 + 2 * k * 12)
        tb = rest // (tq * 8 + d * 4) if rest > 0 else 0
        # Base tiles narrower than k make every merge pay for a full (tq, 2k) top-k; shrink
        # the query tile instead, down to one row.
        if tb >= min(n, max(k, 1024)) or tq == 1:
            break
        tq = max(1, tq // 2)
    return tq, int(max(1, min(n, tb)))


def _mask_self(dist: Tensor, self_ids: Tensor, b0: int) -> None:
    """Set dist[r, self_ids[r] - b0] = inf where that column lies in this base tile (no sync)."""
    width = dist.shape[1]
    cols = self_ids - b0
    inside = (cols >= 0) & (cols < width)
    cols = cols.clamp(0, width - 1).unsqueeze(1)
    cur = dist.gather(1, cols)
    dist.scatter_(1, cols, torch.where(inside.unsqueeze(1), torch.full_like(cur, math.inf), cur))


def _augment(x: Tensor, width: int, query_side: bool) -> Tensor:
    """Rows [x, ||x||^2, 1] (queries) or [-2x, 1, ||x||^2] (base), fp32, zero-padded to width.

    The product of a query tile and a base tile then IS ||q||^2 - 2 q.b + ||b||^2: one GEMM per
    tile pair and no further passes over the (tq, tb) distance tile.
    """
    x = x.float()
    out = x.new_zeros(x.shape[0], width)
    d = x.shape[1]
    sq = x.pow(2).sum(1)
    if query_side:
        out[:, :d] = x
        out[:, d] = sq
        out[:, d + 1] = 1.0
    else:
        out[:, :d] = x * -2.0
        out[:, d] = 1.0
        out[:, d + 1] = sq
    return out


def _knn_torch(queries: Tensor, base: Tensor, k: int, self_ids: Optional[Tensor],
               tile_bytes: Optional[int]) -> Tuple[Tensor, Tensor]:
    q, d = queries.shape
    n = base.shape[0]
    dev = queries.device
    out_d = torch.empty(q, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(q, k, dtype=torch.long, device=dev)
    if q == 0:
        return out_d, out_i
    tq, tb = _tile_sizes(q, n, d + 8, k, _tile_budget(dev, tile_bytes))
    width = (d + 2 + 7) // 8 * 8  # GEMM-friendly inner dimension
    # One distance buffer reused for every full tile: re-allocating ~100 MB per tile costs
    # page faults on the CPU and allocator churn on CUDA.
    buf = torch.empty(tq, tb, dtype=torch.float32, device=dev)
    for q0 in range(0, q, tq):
        qa = _augment(queries[q0:q0 + tq], width, query_side=True)
        rows = qa.shape[0]
        sid = None if self_ids is None else self_ids[q0:q0 + rows]
        best_d = best_i = None
        for b0 in range(0, n, tb):
            ba = _augment(base[b0:b0 + tb], width, query_side=False)
            cols = ba.shape[0]
            dist = buf if (rows, cols) == (tq, tb) else torch.empty(rows, cols, device=dev)
            torch.mm(qa, ba.t(), out=dist)
            if sid is not None:
                _mask_self(dist, sid, b0)
            kk = min(k, cols)
            td, ti = dist.topk(kk, dim=1, largest=False, sorted=False)
            ti += b0
            if best_d is None:
                best_d, best_i = td, ti
            else:
                # Exact running merge: every member of the global top-k is in the top-k of its own
                # tile, so the top-k of (running best U this tile's top-k) is the top-k so far.
                cd = torch.cat([best_d, td], dim=1)
                ci = torch.cat([best_i, ti], dim=1)
                m = min(k, cd.shape[1])
                best_d, pos = cd.topk(m, dim=1, largest=False, sorted=False)
                best_i = ci.gather(1, pos)
        # _check_k guarantees k candidates, so best_* have exactly k columns here. Clamp only
        # the k survivors: cancellation can make (near-)duplicate distances slightly negative.
        best_d, order = best_d.clamp_min(0.0).sort(dim=1)
        out_d[q0:q0 + rows] = best_d
        out_i[q0:q0 + rows] = best_i.gather(1, order)
    return out_d, out_i


# ============================================================================ faiss backend
@functools.lru_cache(maxsize=None)
def _faiss_module():
    try:
        import faiss  # noqa: F401
    except Exception:  # absent, or a broken binary: both mean "not usable"
        return None
    return faiss


def faiss_available() -> bool:
    """True when ``import faiss`` works."""
    return _faiss_module() is not None


def _require_faiss():
    faiss = _faiss_module()
    if faiss is None:
        raise ImportError("backend='faiss' (and approximate search) needs the faiss package: "
                          "`pip install faiss-cpu` (or a faiss GPU build), or use backend='torch'")
    return faiss


@functools.lru_cache(maxsize=None)
def _gpu_resources(device_index: int):
    faiss = _faiss_module()
    return faiss.StandardGpuResources()


@functools.lru_cache(maxsize=None)
def faiss_gpu_usable(device_index: int = 0) -> bool:
    """True when faiss has GPU support that actually runs on CUDA device ``device_index``.

    pip faiss GPU wheels ship no code for some architectures (no sm_90: H100/H200 fail at the
    first search, not at import), so a tiny search is tried once per device and cached; on
    failure a one-line warning is issued and callers fall back (torch backend or faiss CPU).
    """
    faiss = _faiss_module()
    if faiss is None or not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        if faiss.get_num_gpus() <= device_index or not torch.cuda.is_available():
            return False
        import numpy as np
        cfg = faiss.GpuIndexFlatConfig()
        cfg.device = device_index
        index = faiss.GpuIndexFlatL2(_gpu_resources(device_index), 4, cfg)
        x = np.arange(32, dtype="float32").reshape(8, 4)
        index.add(x)
        _, ids = index.search(x[:2], 1)
        if ids[0, 0] != 0 or ids[1, 0] != 1:
            raise RuntimeError(f"probe search returned {ids.ravel().tolist()}, expected [0, 1]")
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use the GPU index"
        msg = " ".join(str(exc).split())[:160]
        warnings.warn(f"faiss GPU index unusable on cuda:{device_index} ({type(exc).__name__}: "
                      f"{msg}); falling back", RuntimeWarning, stacklevel=2)
        return False
    return True


def _to_numpy_f32(t: Tensor):
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


# faiss GPU indexes select at most this many neighbours per query (GPU_MAX_SELECTION_K).
_FAISS_GPU_MAX_K = 2048


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _use_faiss_gpu(device: torch.device, k: int = 1) -> bool:
    return (device.type == "cuda" and k <= _FAISS_GPU_MAX_K
            and faiss_gpu_usable(_cuda_index(device)))


def _build_flat(faiss, d: int, device: torch.device, k: int):
    if _use_faiss_gpu(device, k):
        idx = _cuda_index(device)
        cfg = faiss.GpuIndexFlatConfig()
        cfg.device = idx
        return faiss.GpuIndexFlatL2(_gpu_resources(idx), d, cfg)
    return faiss.IndexFlatL2(d)


def _add_in_chunks(index, base: Tensor, chunk_rows: int = 1 << 18) -> None:
    # Chunks keep the fp32 host copy of a GPU/bf16 base bounded.
    for b0 in range(0, base.shape[0], chunk_rows):
        index.add(_to_numpy_f32(base[b0:b0 + chunk_rows]))


def _search_index(index, queries: Tensor, k: int, chunk_rows: int = 1 << 16
                  ) -> Tuple[Tensor, Tensor]:
    q = queries.shape[0]
    out_d = torch.empty(q, k, dtype=torch.float32)
    out_i = torch.empty(q, k, dtype=torch.long)
    for q0 in range(0, q, chunk_rows):
        dd, ii = index.search(_to_numpy_f32(queries[q0:q0 + chunk_rows]), k)
        out_d[q0:q0 + dd.shape[0]] = torch.from_numpy(dd)
        out_i[q0:q0 + ii.shape[0]] = torch.from_numpy(ii)
    # faiss marks "not found" (approximate indexes only) by -1 with a huge distance.
    missing = out_i < 0
    out_d.masked_fill_(missing, math.inf)
    out_d.clamp_min_(0.0)  # the same expansion as the torch backend: tiny negatives happen
    return out_d, out_i


def drop_self(dist: Tensor, ids: Tensor, self_ids: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """From k+1 results per row, drop the row's own index (or, if absent, the farthest one).
    The one self-exclusion of the package (faiss searches and the sharded search use it)."""
    is_self = ids == self_ids.unsqueeze(1)
    dist = dist.masked_fill(is_self, math.inf)
    ids = ids.masked_fill(is_self, -1)
    # Stable: equal distances keep faiss's order, and self/missing (inf) move to the end.
    dist, order = dist.sort(dim=1, stable=True)
    return dist[:, :k].contiguous(), ids.gather(1, order)[:, :k].contiguous()


def _faiss_search(index, queries: Tensor, k: int, self_ids: Optional[Tensor]
                  ) -> Tuple[Tensor, Tensor]:
    if self_ids is None:
        dist, ids = _search_index(index, queries, k)
    else:
        kk = min(k + 1, index.ntotal)
        dist, ids = _search_index(index, queries, kk)
        dist, ids = drop_self(dist, ids, self_ids.cpu(), k)
    return dist.to(queries.device), ids.to(queries.device)


def _knn_faiss(queries: Tensor, base: Tensor, k: int, self_ids: Optional[Tensor]
               ) -> Tuple[Tensor, Tensor]:
    faiss = _require_faiss()
    if queries.shape[0] == 0:
        dev = queries.device
        return (torch.empty(0, k, dtype=torch.float32, device=dev),
                torch.empty(0, k, dtype=torch.long, device=dev))
    # k + 1 results are searched when the row itself must be dropped.
    index = _build_flat(faiss, base.shape[1], base.device, k + int(self_ids is not None))
    _add_in_chunks(index, base)
    return _faiss_search(index, queries, k, self_ids)


# ============================================================================ approximate
def _default_nlist(n: int) -> int:
    # The usual rule of thumb (~4 sqrt(N) lists), limited so that each list keeps >= 39 training
    # points (faiss warns below that) and at least one list.
    return int(max(1, min(4 * math.isqrt(max(n, 1)), n // 39)))


def _build_approximate(faiss, base: Tensor, kind: str, nlist: Optional[int],
                       nprobe: Optional[int], hnsw_m: int, ef_construction: int,
                       ef_search: Optional[int], k: int, train_size: Optional[int], seed: int):
    n, d = base.shape
    if kind == "ivf":
        nlist = _default_nlist(n) if nlist is None else int(nlist)
        if not 1 <= nlist <= n:
            raise ValueError(f"nlist must be in [1, N={n}], got {nlist}")
        quantizer = faiss.IndexFlatL2(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_L2)
        index.cp.seed = seed
        train_n = min(n, 256 * nlist if train_size is None else int(train_size))
        if train_n < nlist:
            raise ValueError(f"train_size={train_n} is smaller than nlist={nlist}")
        g = torch.Generator().manual_seed(seed)
        sample = torch.randperm(n, generator=g)[:train_n].sort().values
        index.train(_to_numpy_f32(base[sample.to(base.device)]))
        _add_in_chunks(index, base)
        # Default probes: enough lists for high recall at moderate cost (~1/8 of the lists, >= 8).
        index.nprobe = min(nlist, max(8, nlist // 8)) if nprobe is None else int(nprobe)
        if _use_faiss_gpu(base.device, k + 1) and index.nprobe <= _FAISS_GPU_MAX_K:
            dev = _cuda_index(base.device)
            index = faiss.index_cpu_to_gpu(_gpu_resources(dev), dev, index)
        return index
    # HNSW: CPU only in faiss.
    index = faiss.IndexHNSWFlat(d, int(hnsw_m), faiss.METRIC_L2)
    index.hnsw.efConstruction = int(ef_construction)
    _add_in_chunks(index, base)
    index.hnsw.efSearch = max(int(ef_search) if ef_search is not None else 64, 2 * k + 2)
    return index


# ============================================================================ public API
def resolve_knn_backend(backend: str, device: torch.device, k: int = 1) -> str:
    if backend not in KNN_BACKENDS:
        raise ValueError(f"backend must be one of {KNN_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if not faiss_available():
        return "torch"
    if device.type == "cuda":
        # A CPU faiss index would cost two PCIe copies and lose to the torch backend on the GPU.
        return "faiss" if _use_faiss_gpu(device, k) else "torch"
    return "faiss"


def knn(queries: Tensor, base: Tensor, k: int, backend: str = "auto", exclude_self: bool = False,
        approximate: Optional[str] = None, *, tile_bytes: Optional[int] = None,
        nlist: Optional[int] = None, nprobe: Optional[int] = None, hnsw_m: int = 32,
        ef_construction: int = 64, ef_search: Optional[int] = None,
        train_size: Optional[int] = None, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """The ``k`` nearest base rows of every query row, by squared Euclidean distance.

    Args:
        queries: (Q, D) float tensor (fp16/bf16/fp32/fp64; distances are computed in fp32).
        base: (N, D) float tensor on the same device.
        k: neighbours per query, ``1 <= k <= N`` (``<= N - 1`` with ``exclude_self``).
        backend: "torch" (tiled matmul + exact running top-k merge, any device), "faiss"
            (exact ``IndexFlatL2``; a GPU index for CUDA inputs when faiss's GPU support works
            on that device, else the CPU index), or "auto": faiss when it is importable and,
            for CUDA inputs, its GPU index works; otherwise torch.
        exclude_self: the queries ARE the base rows (Q must equal N) and row i never returns i.
            Exact duplicates of row i are still returned (at distance 0).
        approximate: None (exact), "ivf" (faiss ``IndexIVFFlat``) or "hnsw" (faiss
            ``IndexHNSWFlat``, CPU). Needs faiss; ``backend`` must then be "auto" or "faiss".
        tile_bytes: torch backend working-memory budget per tile (default: 256 MiB on CPU, a
            quarter of the free memory on CUDA, at most 4 GiB).
        nlist, nprobe, train_size: IVF lists (default ~4 sqrt(N), >= 39 points per list),
            lists probed per query (default max(8, nlist/8)), training sample (default
            256 nlist) -- more probes: higher recall, slower.
        hnsw_m, ef_construction, ef_search: HNSW graph degree (32), build beam (64), search
            beam (default 64, raised to at least 2k + 2).
        seed: seed of the IVF training sample and k-means.

    Returns:
        ``(distances, indices)``, both (Q, k) on the queries' device: fp32 squared L2 distances
        in ascending order, and int64 row indices into ``base``. Approximate search may find
        fewer than k neighbours for a query; the missing slots are index -1 at distance inf.
        With the "torch" backend and CUDA inputs, matmuls follow PyTorch's TF32 setting (off by
        default); TF32 perturbs distances by ~1e-3 relative and may reorder near ties.

    Raises:
        ValueError: k < 1 or k larger than the number of candidates (message names ``k``);
            empty base; NaN/inf in ``queries`` or ``base`` (message names which); dimension or
            device mismatch; exclude_self with Q != N; unknown backend/approximate.
        TypeError: non-tensor or non-float inputs, non-int k.
        ImportError: backend="faiss" or an approximate index without faiss installed.

    Empty queries (Q = 0) give empty (0, k) results (after k has been checked against N).
    Memory: the torch backend never forms a Q x N matrix (tiles of the budget above); faiss
    holds a copy of the base in its index (fp32, N x D x 4 bytes).
    """
    if approximate not in APPROXIMATE:
        raise ValueError(f"approximate must be one of {APPROXIMATE}, got {approximate!r}")
    k = _validate(queries, base, k, exclude_self)
    self_ids = (torch.arange(base.shape[0], device=queries.device) if exclude_self else None)
    if approximate is not None:
        if backend not in ("auto", "faiss"):
            raise ValueError(f"approximate={approximate!r} uses faiss indexes; backend must be "
                             f"'auto' or 'faiss', got {backend!r}")
        faiss = _require_faiss()
        if queries.shape[0] == 0:
            return (torch.empty(0, k, dtype=torch.float32, device=queries.device),
                    torch.empty(0, k, dtype=torch.long, device=queries.device))
        index = _build_approximate(faiss, base, approximate, nlist, nprobe, hnsw_m,
                                   ef_construction, ef_search, k, train_size, seed)
        return _faiss_search(index, queries, k, self_ids)
    backend = resolve_knn_backend(backend, queries.device, k + int(exclude_self))
    if backend == "faiss":
        return _knn_faiss(queries, base, k, self_ids)
    return _knn_torch(queries, base, k, self_ids, tile_bytes)


_RECALL_PARAMS = {"nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "train_size",
                  "tile_bytes"}


def recall_against_exact(queries: Tensor, base: Tensor, k: int, approximate: str = "ivf",
                         sample: int = 1000, exclude_self: bool = False, seed: int = 0,
                         exact_backend: str = "auto", **params) -> float:
    """Recall@k of an approximate index against exact search, on a random sample of queries.

    Builds the approximate index over all of ``base`` (as :func:`knn` would), searches
    ``min(sample, Q)`` random query rows with it and with exact search, and returns the mean
    over sampled rows of (approximate neighbours found that are as close as the exact k-th
    neighbour) / k -- a float in [0, 1]. Counting by distance rather than by index means
    ties (duplicate points) are not penalised. ``params`` are :func:`knn`'s index parameters
    (nlist, nprobe, train_size, hnsw_m, ef_construction, ef_search; tile_bytes for the exact
    torch search); ``seed`` picks the sample and seeds the IVF training. With ``exclude_self`` the queries are the base rows and each
    sampled row excludes its own index, as in :func:`knn`.
    """
    if approximate not in ("ivf", "hnsw"):
        raise ValueError(f"approximate must be 'ivf' or 'hnsw', got {approximate!r}")
    sample = require_positive_int("sample", sample)
    unknown = set(params) - _RECALL_PARAMS
    if unknown:
        raise TypeError(f"recall_against_exact got unknown parameters {sorted(unknown)}; "
                        f"accepted: {sorted(_RECALL_PARAMS)}")
    k = _validate(queries, base, k, exclude_self)
    faiss = _require_faiss()
    q = queries.shape[0]
    if q == 0:
        raise ValueError("queries is empty: there is nothing to measure recall on")
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(q, generator=g)[:min(int(sample), q)].sort().values.to(queries.device)
    sub = queries[rows]
    self_ids = rows if exclude_self else None
    index = _build_approximate(faiss, base, approximate, params.get("nlist"),
                               params.get("nprobe"), params.get("hnsw_m", 32),
                               params.get("ef_construction", 64), params.get("ef_search"), k,
                               params.get("train_size"), seed)
    a_d, a_i = _faiss_search(index, sub, k, self_ids)
    exact = resolve_knn_backend(exact_backend, queries.device, k + int(exclude_self))
    if exact == "faiss":
        e_d, _ = _knn_faiss(sub, base, k, self_ids)
    else:
        e_d, _ = _knn_torch(sub, base, k, self_ids, params.get("tile_bytes"))
    kth = e_d[:, -1:].float()
    # Same fp32 expansion on both sides; a small relative slack absorbs rounding differences.
    hit = (a_i >= 0) & (a_d <= kth * (1 + 1e-5) + 1e-6)
    return float(hit.sum(1).clamp_max(k).float().mean() / k)


# ============================================================================ neighbour lists
@dataclass
class NeighbourLists:
    """Neighbour lists of a set of centres, as built by :func:`neighbour_lists`.

    indices: (N, k) int64 rows of the centres, own row excluded, nearest first (-1 = padding,
        only from approximate search).
    distances: (N, k) fp32 squared distances matching ``indices`` (inf for padding).
    has_positive: (N,) bool, the list holds a centre with the row's own label.
    num_patched: rows whose last entry was replaced by their nearest same-label centre.
    seconds: wall time of the search (CUDA work synchronised before the clock is read).
    backend: the backend used ("torch", "faiss", "faiss-ivf", "faiss-hnsw").
    """
    indices: Tensor
    distances: Tensor
    has_positive: Tensor
    num_patched: int
    seconds: float
    backend: str


def _has_same_label(indices: Tensor, labels: Tensor) -> Tensor:
    valid = indices >= 0
    nb_labels = labels[indices.clamp_min(0)]
    return ((nb_labels == labels.unsqueeze(1)) & valid).any(dim=1)


def synchronize(device: torch.device) -> None:
    # The calling thread's stream only: a background refresh must not wait for training.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def patch_positives(centres: Tensor, labels: Tensor, rows_offset: int, dist_: Tensor,
                    ids: Tensor, has_pos: Tensor, backend: str, knn_options: dict) -> int:
    """``ensure_positive`` of :func:`neighbour_lists`, in place, for the slice of query rows that
    starts at bank row ``rows_offset`` (``dist_``, ``ids``, ``has_pos`` hold that slice): a row
    without a same-label entry gets its nearest same-label centre (other than itself) in its
    last slot, found among that class's members only. Returns the number of rows patched."""
    approximate = knn_options.get("approximate")
    exact = {key: v for key, v in knn_options.items() if key == "tile_bytes"}
    missing = (~has_pos).nonzero().flatten()
    patched = 0
    for cls in labels[missing + rows_offset].unique().tolist():
        local = missing[labels[missing + rows_offset] == cls]
        rows = local + rows_offset
        members = (labels == cls).nonzero().flatten()
        if members.numel() < 2:  # the only centre of its class: nothing to add
            continue
        # Two nearest members: at most one is the row itself (duplicates aside, where a twin
        # at distance 0 is as good), so the first non-self one is the answer.
        m_d, m_i = knn(centres[rows], centres[members], 2,
                       backend=backend if approximate is None else "auto", **exact)
        m_i = members[m_i]
        first_is_self = m_i[:, 0] == rows
        ids[local, -1] = torch.where(first_is_self, m_i[:, 1], m_i[:, 0])
        dist_[local, -1] = torch.where(first_is_self, m_d[:, 1], m_d[:, 0])
        has_pos[local] = True
        patched += int(local.numel())
    if patched and approximate is not None:  # padding may precede the patched last slot
        sorted_d, order = dist_.sort(dim=1, stable=True)
        dist_.copy_(sorted_d)
        ids.copy_(ids.gather(1, order))
    return patched


def neighbour_lists(centres: Tensor, labels: Tensor, k: int, backend: str = "auto",
                    ensure_positive: bool = False, **knn_options) -> NeighbourLists:
    """The k nearest other centres of every centre (self excluded), optionally with a positive.

    Args:
        centres: (N, D) float tensor; labels: (N,) int tensor on the same device.
        k: list length, 1 <= k <= N - 1.
        backend, knn_options: as in :func:`knn` (``approximate=``, ``tile_bytes=``, ...).
        ensure_positive: a row whose k neighbours hold no centre of its own label gets its
            nearest same-label centre (other than itself) in place of its last entry, when one
            exists. Found by one search per class that has such rows, among that class's
            members only (never an N x N matrix). Without a positive, the loss of that row is
            undefined (see DESIGN.md 1), so this keeps every row trainable.
    """
    require_labelled("centres", centres, "labels", labels)
    labels = labels.to(centres.device).long()
    approximate = knn_options.get("approximate")
    used = (f"faiss-{approximate}" if approximate is not None
            else resolve_knn_backend(backend, centres.device, k + 1))
    synchronize(centres.device)
    t0 = time.perf_counter()
    dist, idx = knn(centres, centres, k, backend=backend, exclude_self=True, **knn_options)
    has_pos = _has_same_label(idx, labels)
    num_patched = 0
    if ensure_positive:
        num_patched = patch_positives(centres, labels, 0, dist, idx, has_pos, backend,
                                      knn_options)
    synchronize(centres.device)
    return NeighbourLists(idx, dist, has_pos, num_patched, time.perf_counter() - t0, used)
