"""Exact k-nearest-neighbour search with torch GEMMs, never forming (Q, N).

fp32 distances from one GEMM per tile of augmented rows, clamped at 0, ranked by
``(distance bits << 32) | index`` keys, as faiss's flat index. On the CPU the compiled library
selects each tile after its GEMM (a self-search only the tiles on and above the diagonal);
elsewhere a sampled threshold per (rows, N) block, or base tiles with a running top-k.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from .exclusion import drop_self

__all__ = ["iter_knn_torch", "tile_budget", "tile_sizes", "same_tensor",
           "symmetric_block"]

# Columns sampled per query row for the threshold: min(SAMPLE_COLUMNS, N / 4), and no sample
# (exact threshold) below MIN_SAMPLE_COLUMNS.
SAMPLE_COLUMNS = 4096
MIN_SAMPLE_COLUMNS = 256
# Fewest query rows worth one (rows, N) block; below this the base is tiled too.
_MIN_BLOCK_ROWS = 16
_INT64_MAX = torch.iinfo(torch.int64).max
# CPU tiles by the compiled library's GEMM where it has one; False: torch.mm (for tests).
COMPILED_GEMM = True
# Compiled CPU path: the largest distance tile.
QUERY_TILE = 2048
BASE_TILE = 4096
# Symmetric self-search: square blocks, halved down to SYM_MIN_BLOCK to fit the budget, for
# k <= SYM_MAX_K_PER_WIDTH * width only (docs/PERFORMANCE.md).
SYM_BLOCK = 2048
SYM_MIN_BLOCK = 512
SYM_MAX_K_PER_WIDTH = 3


def tile_budget(device: torch.device, tile_bytes: Optional[int]) -> int:
    """Working memory (distance block, mask, kept entries): ``tile_bytes``, else 256 MiB on the
    CPU; on CUDA a quarter of the free memory, at most 4 GiB (bigger tiles stop paying off)."""
    if tile_bytes is not None:
        if (isinstance(tile_bytes, bool) or not isinstance(tile_bytes, numbers.Real)
                or not tile_bytes >= 1):
            raise ValueError(f"tile_bytes must be a positive number of bytes (None: the "
                             f"default), got {tile_bytes!r}")
        return int(tile_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(max(free * 0.25, 32 * 2**20), 4 * 2**30))
    return 256 * 2**20


def tile_sizes(q: int, n: int, d: int, k: int, budget: int) -> Tuple[int, int]:
    """(query rows, base rows) per tile of the running-merge path within ``budget`` bytes:
    the distance tile and its int64 keys, the operand tiles and the (tq, 2k) merge buffers."""
    tq = max(1, min(q, 4096))
    while True:
        rest = budget - tq * (d * 4 + 2 * k * 16)
        tb = rest // (tq * 12 + d * 4) if rest > 0 else 0
        # base tiles narrower than k make every merge a full (tq, 2k) top-k: shrink tq instead
        if tb >= min(n, max(k, 1024)) or tq == 1:
            break
        tq = max(1, tq // 2)
    return tq, int(max(1, min(n, tb)))


def distance_tile(qa: Tensor, ba: Tensor, out: Tensor) -> Tensor:
    """``out`` = ``qa @ ba.T``: the compiled library's GEMM on the CPU (bits independent of
    tile, path and threads) where COMPILED_GEMM allows, else ``torch.mm``."""
    if COMPILED_GEMM and out.is_cpu:
        from ... import cpu
        if cpu.gemm_nt(qa, ba, out):
            return out
    return torch.mm(qa, ba.t(), out=out)


def _augment(x: Tensor, width: int, query_side: bool) -> Tensor:
    """Rows [x, ||x||^2, 1] (queries) or [-2x, 1, ||x||^2] (base), fp32, zero-padded to width:
    their product is the squared distance."""
    x = x.float()
    out = x.new_zeros(x.shape[0], width)
    d = x.shape[1]
    out[:, :d] = x if query_side else x * -2.0
    out[:, d + int(not query_side)] = x.pow(2).sum(1)
    out[:, d + int(query_side)] = 1.0
    return out


def _keys(dist: Tensor, ids: Tensor) -> Tensor:
    """int64 keys ordered as (distance, index); "+ 0.0" turns -0.0 into +0.0."""
    bits = dist.clamp_min(0.0).add_(0.0).view(torch.int32).long()
    return bits.bitwise_left_shift_(32).bitwise_or_(ids)


def _unkey(keys: Tensor) -> Tuple[Tensor, Tensor]:
    return (keys >> 32).int().view(torch.float32), keys & 0xFFFFFFFF


def _sample_rank(k: int, s: int, n: int) -> int:
    """Rank in a sample of s of n columns at or above the k-th smallest of all n with
    probability ~1 - 3e-5 (mean + 4 sd of the hypergeometric count)."""
    p = min(1.0, s / n)
    mean = k * p
    return int(min(s, math.ceil(mean + 4.0 * math.sqrt(mean * (1.0 - p)) + 1.0)))


def _select(block: Tensor, tau: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat positions (ascending) of the entries of the contiguous ``block`` (rows, n) at most
    ``tau`` (rows,), their rows, the count per row and where each row's entries start."""
    rows, n = block.shape
    flat = (block <= tau.unsqueeze(1)).view(-1).nonzero().squeeze(1)
    r = torch.div(flat, n, rounding_mode="floor")
    bounds = torch.searchsorted(r, torch.arange(rows + 1, device=r.device))
    return flat, r, bounds[1:] - bounds[:-1], bounds[:-1]


def _knn_block(block: Tensor, k: int, sample_columns: int, sample_k: int,
               ids: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The k smallest of each row of a (rows, n) distance block, by (distance, index). With
    ``sample_columns`` > 0 column j is base row ``ids[j]`` (a random permutation) and the first
    columns are the threshold's sample; else the threshold is exact."""
    rows, n = block.shape
    cols, rank = (sample_columns, sample_k) if sample_columns else (n, k)
    tau = block[:, :cols].topk(rank, dim=1, largest=False, sorted=False).values.amax(dim=1)
    # Clamped distances tie at 0: every entry <= 0 must be kept when tau is below 0.
    tau = tau.clamp_min(0.0)
    flat, r, counts, offsets = _select(block, tau)
    short = counts < k
    if bool(short.any()):  # the sample's threshold fell below the k-th value (rare)
        bad = short.nonzero().flatten()
        tau[bad] = block[bad].topk(k, dim=1, largest=False, sorted=False).values.amax(
            dim=1).clamp_min(0.0)
        flat, r, counts, offsets = _select(block, tau)
    c = flat - r * n
    keys = _keys(block.view(-1).take(flat), c if ids is None else ids[c])
    width = int(counts.max())
    dest = torch.arange(flat.shape[0], device=block.device).add_(r * width - offsets[r])
    packed = torch.full((rows, width), _INT64_MAX, dtype=torch.int64, device=block.device)
    packed.view(-1)[dest] = keys
    return _unkey(packed.topk(k, dim=1, largest=False, sorted=True).values)


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` are views of the same memory with the same layout."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
                      and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                      and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def iter_knn_torch(queries: Tensor, base: Tensor, k: int, tile_bytes: Optional[int] = None,
                   self_search: bool = False, exclude_self: bool = False,
                   out: Optional[Tuple[Tensor, Tensor]] = None
                   ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Yield ``(row0, distances (rows, k) fp32, indices (rows, k) int64)`` per block of query
    rows (arguments checked by the caller). ``self_search``: ``queries`` is ``base``;
    ``out``: the whole (Q, k) result, which the compiled selection decodes into."""
    q, d = queries.shape
    n = base.shape[0]
    dev = queries.device
    if q == 0:
        return
    kk = k + int(exclude_self)
    budget = tile_budget(dev, tile_bytes)
    width = (d + 2 + 7) // 8 * 8  # GEMM-friendly inner dimension
    if dev.type == "cpu" and n < 2**31:
        s = (symmetric_block(n, kk, budget)
             if self_search and kk <= SYM_MAX_K_PER_WIDTH * width else 0)
        tq, tb, cap = (s, s, kk + max(kk, 64)) if s else cpu_tile_sizes(q, n, kk, budget)
        from ... import cpu  # the compiled selection (library built on first use) or None
        sel = cpu.knn_selection(n if s else tq, kk, cap)
        if sel is not None:
            yield from _iter_knn_compiled(queries, base, kk, width, tq, tb, sel, exclude_self,
                                          out, symmetric=bool(s))
            return
    for q0, dist, idx in _iter_knn_threshold(queries, base, kk, budget, width):
        if exclude_self:
            dist, idx = drop_self(dist, idx, torch.arange(q0, q0 + idx.shape[0], device=dev), k)
        yield q0, dist, idx


def _iter_knn_threshold(queries: Tensor, base: Tensor, k: int, budget: int, width: int
                        ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """The torch selection: (rows, N) blocks and the sampled threshold, or base tiles."""
    q = queries.shape[0]
    n = base.shape[0]
    dev = queries.device
    s = min(SAMPLE_COLUMNS, n // 4)
    sample_k = _sample_rank(k, s, n) if s > 0 else k
    use_sample = s >= MIN_SAMPLE_COLUMNS and sample_k <= s // 2
    # per row: distances, mask, sampled columns and the kept entries (~2k keys, coordinates)
    per_row = n * 5 + width * 4 + 64 * max(k, 1)
    tq = min(q, 4096, max(1, (budget - n * width * 4) // per_row))
    if tq >= min(q, _MIN_BLOCK_ROWS):
        # a fixed random order of base rows: the first columns are the sample
        ids = (torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(dev)
               if use_sample else None)
        ba = _augment(base if ids is None else base[ids], width, query_side=False)
        buf = torch.empty(tq, n, dtype=torch.float32, device=dev)
        for q0 in range(0, q, tq):
            qa = _augment(queries[q0:q0 + tq], width, query_side=True)
            block = buf[:qa.shape[0]]
            distance_tile(qa, ba, block)
            yield (q0, *_knn_block(block, k, s if use_sample else 0, sample_k, ids))
        return
    yield from _iter_knn_tiled(queries, base, k, budget, width)


def cpu_tile_sizes(q: int, n: int, k: int, budget: int) -> Tuple[int, int, int]:
    """(query rows, base rows, keys per row) of the compiled CPU path within ``budget``."""
    cap = k + max(k, 64)
    tq = max(1, min(q, QUERY_TILE))
    tb = max(1, min(n, BASE_TILE))
    while tq > 1 and tq * (tb * 4 + cap * 8 + k * 12) > budget:
        tq = max(1, tq // 2)
    while tb > 1 and tq * (tb * 4 + cap * 8 + k * 12) > budget:
        tb = max(1, tb // 2)
    return tq, tb, cap


def symmetric_block(n: int, k: int, budget: int) -> int:
    """Points per square block of the symmetric self-search within ``budget``, else 0."""
    cap = k + max(k, 64)
    s = max(1, min(n, SYM_BLOCK))
    floor = min(s, SYM_MIN_BLOCK)
    state = n * (cap * 8 + 16)
    while s > floor and state + s * (s * 4 + k * 12) > budget:
        s = max(floor, s // 2)
    return s if state + s * (s * 4 + k * 12) <= budget else 0


def decoded_into(out: Tuple[Tensor, Tensor], row0: int, dist: Tensor, idx: Tensor) -> bool:
    """Whether a block :func:`iter_knn_torch` yielded already lies in ``out``'s rows."""
    return (dist.data_ptr() == out[0][row0].data_ptr()
            and idx.data_ptr() == out[1][row0].data_ptr())


def _iter_knn_compiled(queries: Tensor, base: Tensor, k: int, width: int, tq: int, tb: int,
                       sel, exclude_self: bool, out: Optional[Tuple[Tensor, Tensor]] = None,
                       symmetric: bool = False) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """(tq, tb) tiles, each folded into the C++ selection straight after its GEMM.

    ``symmetric`` (``queries`` is ``base``, square tiles): only tiles (I, J), J >= I, get a
    GEMM, feeding block I's rows and block J's. I outer, J inner hands every point its
    candidates in ascending index order; block I is final after outer iteration I.
    """
    q = queries.shape[0]
    n = base.shape[0]
    ba = _augment(base, width, query_side=False)
    buf = torch.empty(tq * tb, dtype=torch.float32)
    if symmetric:
        sel.reset(n)
    for q0 in range(0, q, tq):
        qa = _augment(queries[q0:q0 + tq], width, query_side=True)
        rows = qa.shape[0]
        if not symmetric:
            sel.reset(rows)
        for b0 in range(q0 if symmetric else 0, n, tb):
            cols = min(tb, n - b0)
            tile = buf[:rows * cols].view(rows, cols)  # contiguous whatever the tile's shape
            distance_tile(qa, ba[b0:b0 + cols], tile)
            if symmetric:
                sel.add_symmetric(tile, q0, b0)
            else:
                sel.add(tile, b0)
        rows_out = None if out is None else (out[0][q0:q0 + rows], out[1][q0:q0 + rows])
        yield (q0, *sel.finish(q0 if symmetric else 0, rows, self0=q0 if exclude_self else None,
                               out=rows_out))


def _iter_knn_tiled(queries: Tensor, base: Tensor, k: int, budget: int, width: int
                    ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Base tiled too: a running top-k of (distance, index) keys (exact)."""
    q = queries.shape[0]
    n = base.shape[0]
    dev = queries.device
    tq, tb = tile_sizes(q, n, width, k, budget)
    buf = torch.empty(tq, tb, dtype=torch.float32, device=dev)
    for q0 in range(0, q, tq):
        qa = _augment(queries[q0:q0 + tq], width, query_side=True)
        rows = qa.shape[0]
        best = None
        for b0 in range(0, n, tb):
            ba = _augment(base[b0:b0 + tb], width, query_side=False)
            cols = ba.shape[0]
            dist = buf[:rows, :cols]
            distance_tile(qa, ba, dist)
            ids = torch.arange(b0, b0 + cols, device=dev).expand(rows, cols)
            keys = _keys(dist, ids)
            top = keys.topk(min(k, cols), dim=1, largest=False, sorted=False).values
            if best is not None:
                top = torch.cat([best, top], dim=1)
                top = top.topk(min(k, top.shape[1]), dim=1, largest=False, sorted=False).values
            best = top
        yield (q0, *_unkey(best.sort(dim=1).values))

