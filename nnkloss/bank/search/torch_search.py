"""Exact k-nearest-neighbour search with torch GEMMs: a compiled selection on the CPU, a threshold
selection in torch elsewhere.

Distances are ``||q||^2 - 2 q.b + ||b||^2`` in fp32, produced by one GEMM per tile of augmented
rows (queries ``[q, ||q||^2, 1]``, base ``[-2b, 1, ||b||^2]``, zero-padded to a multiple of 8
columns; :func:`distance_tile`), clamped at 0 (cancellation can make near-duplicates slightly
negative; -0.0 becomes +0.0). The GEMM: on the CPU the compiled library's own where it has one
(AVX-512 builds, ``nnk_gemm_nt``: each distance one dot product summed in column order, so its
bits depend on the pair alone, whatever the tile, path or thread count; 2.2-2.65x torch.mm on
the 2-core AMD EPYC family 26, where MKL runs its AVX2 code), else ``torch.mm``. Neighbours
come out in (distance, index) order: equal distances are ordered by base index, as faiss's
flat index orders them, so both exact backends agree wherever they compute the same
distances. Both selections below rank the same uint64/int64 keys ``(float bits of the clamped
distance << 32) | base index`` (non-negative floats order as their bits; keys are unique), so
they return identical lists whenever their GEMMs give the same distance bits: always with the
library's GEMM; with MKL on every shape tested (tests/test_search.py checks random data as
well as exactly representable data with ties), though a BLAS that rounds a product
differently for another tile shape could swap neighbours whose distances differ by a rounding
error. The
symmetric self-search below computes the distance of a pair once, with the point of the
earlier block on the query side, for both points' lists: where the blockwise path computes
it the other way round the bits can differ by a rounding error, so the lists are identical on
exactly representable data (ties included) and otherwise equal up to such near-ties (each
still the exact k smallest by (distance, index) of the distances computed).

CPU with the compiled library (``nnkloss/ops/cpu_kernel.cpp``, ``nnk_knn_select`` /
``nnk_knn_pad``; the default wherever the library builds):

1. tiles of at most QUERY_TILE x BASE_TILE (2048 x 4096: 32 MiB of fp32, about the last-level
   cache) are computed one at a time, base tiles in ascending index order;
2. straight after its GEMM, each tile is folded into a per-row selection in C++ (rows shared
   out to the threads): per query row a buffer of ``cap = k + max(k, 64)`` keys holds every
   candidate below ``worst``, a key that at least k held keys are at or below; when the buffer
   is full it is compacted: the keys above a new ``worst`` are dropped, ``worst`` being a key a
   little above the k-th smallest, picked from a 128-key sample of the buffer and checked by
   counting (buffers of 1,024 keys and more; where the count finds fewer than k keys under
   it, the sample's key 16 ranks higher; in smaller buffers, with AVX-512, the one of 16
   spaced keys with the fewest keys at or below it, at least k, each counted in the whole
   buffer; where these mislead, or without AVX-512 in small buffers, ``nth_element`` keeps
   the k smallest and ``worst`` becomes the largest of them). A key at
   or above ``worst`` cannot be among the k smallest (k keys at most ``worst`` are held), so
   nothing the result needs is dropped: exact by construction whatever the sample, one pass.
   As the base arrives in index order, a new key is below ``worst`` exactly when its distance
   is below ``worst``'s, so a vectorised prefilter compares 16 (AVX-512; 8 with AVX2) raw
   distances at a time with that float and only the chunks holding a candidate reach the key
   path (with AVX-512 the chunk's keys built and stored as vectors, one at a time elsewhere);
3. after the last base tile each row's whole buffer, padded past its count with the largest
   key, is sorted by numpy (SIMD where numpy has it; :meth:`nnkloss.ops.cpu.KnnSelection.finish`;
   the rows shared out to the library's threads, which call numpy back) and its first k keys
   are the result; distances come back from the key bits, indices from
   the low 32 bits (the path needs N < 2**31). With ``exclude_self`` k + 1 are selected and
   the decode leaves each row's own index out (the rule of :func:`..exclusion.drop_self`).

Memory (CPU, compiled): the augmented base copy (N x width fp32, width = D + 2 rounded up to 8),
one distance tile and, per query row of a tile, ``cap`` keys and the (k,) results:
``tq * (tb * 4 + cap * 8 + k * 12)`` bytes, kept within ``tile_bytes`` by shrinking the query
tile, then the base tile (:func:`cpu_tile_sizes`). Never a (Q, N) matrix. The library's GEMM
adds, for the length of each call, a packed copy of the query tile (``tq * width`` fp32, the
size of the augmented tile itself: 1.1 MB at 2048 x 136) and 32 x width floats per thread.

Symmetric self-search (CPU, compiled; :func:`..knn.iter_knn` with the queries the same tensor
as the base, :func:`same_tensor`, with or without ``exclude_self``; for k up to
SYM_MAX_K_PER_WIDTH = 3 times the augmented width, above which it is slower): the distance
matrix is symmetric, so only the tiles on and above the diagonal need a GEMM, about half the
FLOPs:

1. square blocks of S points (SYM_BLOCK = 2048); tiles (I, J), J >= I, I outer, J inner, one
   GEMM each (augmented block I against augmented block J, as above);
2. in one C++ call per tile (``nnk_knn_select_sym``) the rows of block I take the tile's
   columns (the row scan above) and, off the diagonal, the rows of block J take the tile's rows
   (a column scan: items of 128 columns walked down the tile's rows, each row's 128 floats
   compared, 16 at a time with AVX-512, with those columns' thresholds; no transposed copy).
   The selection keeps every point's state (N rows);
3. with I outer and J inner, a point of block P receives blocks 0 .. P-1 (column sides of
   the tiles (I, P), I < P), then P (the diagonal tile, row side only: it holds both orders of
   each pair), then P+1 .. (row sides): every point's candidates arrive in ascending index
   order, which the prefilter's exactness needs. Block P is final after its row of tiles and
   is finished and yielded then (blocks in ascending row order, as elsewhere).

Memory: the state of all N points, one (S, S) tile and one block's results,
``N * (cap * 8 + 16) + S * (S * 4 + k * 12)`` bytes, within ``tile_bytes`` (S halves down to
SYM_MIN_BLOCK = 512), else the blockwise path above (:func:`symmetric_block`): the default
CPU budget (256 MiB) takes N = 1e5, k = 100 (163 MB of state); the metrics' 1 GiB never takes
N = 150,000, k = 1,500 (3.6 GB).

Elsewhere (CUDA tensors, or the library unavailable: no compiler, ``NNKLOSS_CPU_KERNEL=0``),
the torch selection. Where the time goes: the GEMM is the floor (O(Q N D)). ``torch.topk`` over
a wide tile costs about as much again at k in the hundreds to thousands, so it avoids that:

1. one GEMM gives a (rows, N) block of distances (rows chosen so the block fits the budget);
2. a per-row threshold ``tau`` that is at least the k-th smallest distance: from a fixed random
   sample of S = min(4096, N / 4) columns of the block (the base is searched in a fixed random
   order, so the sample is the block's first S columns), the order statistic that lies above
   the k-th smallest distance with probability ~1 - 3e-5 (mean + 4 standard deviations of its
   hypergeometric count), or the exact k-th value when N is small (S < 256);
3. one compare and one ``nonzero`` keep the entries ``<= tau`` (about k (1 + 4/sqrt(k S / N))
   per row); a row that keeps fewer than k (the 3e-5 event) gets its exact k-th value and the
   block is compared again, so the result never depends on the sample;
4. the kept entries, packed as int64 keys ``(float bits of the distance << 32) | index``,
   are ordered by one top-k: unique keys, so ties are broken by index deterministically.

Memory per block: the distance block, a bool mask of the same shape and the kept entries
(a budget of 256 MiB on the CPU by default). When even 16 query rows of N columns exceed the
budget (N in the millions), base tiles are merged with a running top-k over the same keys.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from .exclusion import drop_self

__all__ = ["knn_torch", "iter_knn_torch", "tile_budget", "tile_sizes", "same_tensor",
           "symmetric_block"]

# Working-memory budget on the CPU (distance block + mask + kept entries).
_CPU_TILE_BYTES = 256 * 2**20
# On CUDA the budget is this share of the free memory, capped (bigger tiles stop paying off).
_CUDA_FREE_SHARE = 0.25
_CUDA_TILE_BYTES_MAX = 4 * 2**30
# Columns sampled per query row for the threshold: min(SAMPLE_COLUMNS, N / 4), and no sample
# (exact threshold) below MIN_SAMPLE_COLUMNS.
SAMPLE_COLUMNS = 4096
MIN_SAMPLE_COLUMNS = 256
# Fewest query rows worth one (rows, N) block; below this the base is tiled too.
_MIN_BLOCK_ROWS = 16
_INT64_MAX = torch.iinfo(torch.int64).max
# CPU distance tiles by the compiled library's GEMM where it has one (distance_tile); False:
# torch.mm everywhere (for A/B timings and tests).
COMPILED_GEMM = True
# Compiled CPU path: largest (query rows, base rows) distance tile. 2048 x 4096 fp32 (32 MiB)
# is read by the selection straight after the GEMM writes it, mostly from the last-level cache.
# Smaller tiles (512 x 2048) run as fast on an idle 2-core machine, but every tile is one GEMM
# and one selection call, each a fork-join across the threads, and on a loaded machine each
# join can wait a time slice for a descheduled thread: fewer, larger calls degrade less. With
# the library's GEMM (2026-11-27, the 2-core AMD EPYC family 26, evaluation's search at
# k 1,499, ad hoc, in one process): 1024 x 2048 tiles took 5.84-5.99 s against 6.58-6.80 s at
# N 60,000 idle (three rounds), but 7.71-7.98 s against 5.86-7.79 s at N 30,000 beside a
# 2-thread matmul process: kept.
QUERY_TILE = 2048
BASE_TILE = 4096
# Symmetric self-search (compiled CPU path, queries = base): square blocks of this many points,
# shrunk (not below SYM_MIN_BLOCK) until the state fits the budget (:func:`symmetric_block`).
# 2048 (a 16 MiB tile, within the 32 MiB last-level cache) against 4096 (64 MiB), N = 1e5,
# D = 128, k = 101, 2 threads, load 1.0-1.5 (the machine shared): 8.3 / 7.9 s against 8.9 /
# 8.9 s (GEMM 6.5 / 6.3 s against 7.0 / 7.1 s; selection 1.7 / 1.6 s against 1.9 / 1.9 s).
# Its tile count, hence its count of fork-joins (see QUERY_TILE), equals the blockwise path's.
SYM_BLOCK = 2048
SYM_MIN_BLOCK = 512
# ... and only for lists of at most this many neighbours per column of the augmented rows
# (k <= SYM_MAX_K_PER_WIDTH * width, width = D + 2 rounded up to 8): the symmetric search saves
# half the GEMM, whose work per pair grows with the width, and its column side adds fold work
# per pair that grows with k (each point's first candidates, the fill and most insertions,
# arrive there, on the states of other points). Measured crossovers (2026-11-27, the 2-core AMD
# EPYC family 26, self-searches of N points, two threads, ad hoc, docs/PERFORMANCE.md,
# "Evaluation at scale"): D 64 (width 72) at k 200-300 (N 20,000 and 60,000); D 128 (width
# 136) at k 300-500 (20,000) and 500-1,000 (60,000); D 256 (width 264) at k 500-800; at k
# 1,000, D 64 the symmetric search took 1.5x the blockwise one's time.
SYM_MAX_K_PER_WIDTH = 3


def tile_budget(device: torch.device, tile_bytes: Optional[int]) -> int:
    if tile_bytes is not None:
        # 0 or a negative budget ran as 1 byte (tiles of one query and one base row: 100x
        # slower at N = 300, hours at N in the tens of thousands) and a string failed in int()
        # without naming the argument.
        if (isinstance(tile_bytes, bool) or not isinstance(tile_bytes, numbers.Real)
                or not tile_bytes >= 1):
            raise ValueError(f"tile_bytes must be a positive number of bytes (None: the "
                             f"default), got {tile_bytes!r}")
        return int(tile_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(max(free * _CUDA_FREE_SHARE, 32 * 2**20), _CUDA_TILE_BYTES_MAX))
    return _CPU_TILE_BYTES


def tile_sizes(q: int, n: int, d: int, k: int, budget: int) -> Tuple[int, int]:
    """(query rows, base rows) per tile so that the fp32 working set fits in ``budget`` bytes.

    Per tile of the running-merge path: the (tq, tb) distance tile and its int64 keys (12 bytes
    per entry), the fp32 operand tiles and the (tq, 2k) merge buffers.
    """
    tq = max(1, min(q, 4096))
    while True:
        rest = budget - tq * (d * 4 + 2 * k * 16)
        tb = rest // (tq * 12 + d * 4) if rest > 0 else 0
        # Base tiles narrower than k make every merge pay for a full (tq, 2k) top-k; shrink
        # the query tile instead, down to one row.
        if tb >= min(n, max(k, 1024)) or tq == 1:
            break
        tq = max(1, tq // 2)
    return tq, int(max(1, min(n, tb)))


def distance_tile(qa: Tensor, ba: Tensor, out: Tensor) -> Tensor:
    """``out`` (rows, cols) = the squared distances of augmented query rows ``qa`` (rows, width)
    to augmented base rows ``ba`` (cols, width): their product ``qa @ ba.T``, every path's one
    GEMM. On the CPU, where the compiled library has its own GEMM (AVX-512 builds;
    :func:`nnkloss.ops.cpu.gemm_nt`) and COMPILED_GEMM is set, that one: each distance is then
    one dot product summed in column order, the same bits for a pair whatever the tile, path
    or thread count, and 2.2-2.65x torch.mm's speed on the 2-core AMD EPYC family 26 (MKL runs
    its AVX2 code there; docs/PERFORMANCE.md, "The kNN graph"). Elsewhere ``torch.mm``."""
    if COMPILED_GEMM and out.is_cpu:
        from ...ops import cpu
        if cpu.gemm_nt(qa, ba, out):
            return out
    return torch.mm(qa, ba.t(), out=out)


def _augment(x: Tensor, width: int, query_side: bool) -> Tensor:
    """Rows [x, ||x||^2, 1] (queries) or [-2x, 1, ||x||^2] (base), fp32, zero-padded to width.

    The product of a query tile and a base tile then IS ||q||^2 - 2 q.b + ||b||^2: one GEMM per
    tile pair and no further passes over the distance tile.
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


def _keys(dist: Tensor, ids: Tensor) -> Tensor:
    """int64 keys ordered as (distance, index): the bits of a non-negative fp32 order as the
    float does, and indices are < 2**31."""
    # "+ 0.0" turns -0.0 (sign bit set: it would order first) into +0.0.
    bits = dist.clamp_min(0.0).add_(0.0).view(torch.int32).long()
    return bits.bitwise_left_shift_(32).bitwise_or_(ids)


def _unkey(keys: Tensor) -> Tuple[Tensor, Tensor]:
    return (keys >> 32).int().view(torch.float32), keys & 0xFFFFFFFF


def _sample_rank(k: int, s: int, n: int) -> int:
    """Rank in a random sample of s of the n columns whose value lies at or above the k-th
    smallest of all n with probability ~1 - 3e-5 (the count of sampled columns below the k-th
    is hypergeometric: mean k s / n, variance <= k s / n (1 - s / n))."""
    p = min(1.0, s / n)
    mean = k * p
    return int(min(s, math.ceil(mean + 4.0 * math.sqrt(mean * (1.0 - p)) + 1.0)))


def _select(block: Tensor, tau: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat positions (ascending) of the entries of the contiguous ``block`` (rows, n) at most
    ``tau`` (rows,), their rows, the count per row and where each row's entries start."""
    rows, n = block.shape
    # One flat index per kept entry: cheaper to produce and to gather with than (row, col).
    flat = (block <= tau.unsqueeze(1)).view(-1).nonzero().squeeze(1)
    r = torch.div(flat, n, rounding_mode="floor")
    bounds = torch.searchsorted(r, torch.arange(rows + 1, device=r.device))
    return flat, r, bounds[1:] - bounds[:-1], bounds[:-1]


def _knn_block(block: Tensor, k: int, sample_columns: int, sample_k: int,
               ids: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The k smallest of each row of a (rows, n) distance block, by (distance, index).

    ``sample_columns``: when > 0, the block's columns are a random permutation of the base
    (column j is base row ``ids[j]``), so its first ``sample_columns`` columns are a random
    sample for the threshold; 0: exact threshold (``ids`` None: column j is base row j).
    """
    rows, n = block.shape
    if sample_columns:
        tau = block[:, :sample_columns].topk(sample_k, dim=1, largest=False,
                                             sorted=False).values.amax(dim=1)
    else:
        tau = block.topk(k, dim=1, largest=False, sorted=False).values.amax(dim=1)
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
    # Entry j of the kept list sits at column j - offsets[row] of its row of the packed matrix.
    dest = torch.arange(flat.shape[0], device=block.device).add_(r * width - offsets[r])
    packed = torch.full((rows, width), _INT64_MAX, dtype=torch.int64, device=block.device)
    packed.view(-1)[dest] = keys
    top = packed.topk(k, dim=1, largest=False, sorted=True).values
    return _unkey(top)


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` are views of the same memory with the same layout: same
    storage, data pointer, shape, strides, dtype and device (then they hold the same values)."""
    if a is b:
        return True
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def iter_knn_torch(queries: Tensor, base: Tensor, k: int, tile_bytes: Optional[int] = None,
                   self_search: bool = False, exclude_self: bool = False,
                   out: Optional[Tuple[Tensor, Tensor]] = None
                   ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Yield ``(row0, distances (rows, k) fp32, indices (rows, k) int64)`` for consecutive
    blocks of query rows: the k nearest base rows of each, by (distance, index).

    Arguments are assumed validated (:func:`..validation.validate`).
    ``self_search``: the caller vouches that ``queries`` IS ``base`` (:func:`same_tensor`);
    on the CPU with the compiled library, when the state fits the budget
    (:func:`symmetric_block`) and k is at most SYM_MAX_K_PER_WIDTH times the augmented
    width, the symmetric search then computes each pair once.
    ``exclude_self``: query row i is base row i (Q = N) and leaves its own list: k + 1 are
    searched and the own index dropped as :func:`..exclusion.drop_self` drops it, by the
    compiled selection's decode (``KnnSelection.finish``'s ``self0``) where it runs, by
    drop_self elsewhere.
    ``out``: the caller's whole result, contiguous (Q, k) fp32 and int64 tensors on the
    queries' device. The compiled selection decodes each block into its rows and yields those
    rows (views of ``out``): the caller's copy of a block is then no copy at all. The other
    paths yield blocks of their own: copy those (:func:`decoded_into`).
    """
    q, d = queries.shape
    n = base.shape[0]
    dev = queries.device
    if q == 0:
        return
    kk = k + int(exclude_self)
    budget = tile_budget(dev, tile_bytes)
    width = (d + 2 + 7) // 8 * 8  # GEMM-friendly inner dimension
    if (dev.type == "cpu" and n < 2**31 and self_search
            and kk <= SYM_MAX_K_PER_WIDTH * width):
        s = symmetric_block(n, kk, budget)
        if s:
            sel = _compiled_selection(n, kk, kk + max(kk, 64))
            if sel is not None:
                yield from _iter_knn_symmetric(base, kk, width, s, sel, exclude_self, out)
                return
    if dev.type == "cpu" and n < 2**31:
        tq, tb, cap = cpu_tile_sizes(q, n, kk, budget)
        sel = _compiled_selection(tq, kk, cap)
        if sel is not None:
            yield from _iter_knn_compiled(queries, base, kk, width, tq, tb, sel, exclude_self,
                                          out)
            return
    for q0, dist, idx in _iter_knn_threshold(queries, base, kk, budget, width):
        if exclude_self:
            dist, idx = drop_self(dist, idx, torch.arange(q0, q0 + idx.shape[0], device=dev), k)
        yield q0, dist, idx


def _iter_knn_threshold(queries: Tensor, base: Tensor, k: int, budget: int, width: int
                        ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """The torch selection (CUDA, or no compiled library): (rows, N) distance blocks and the
    sampled threshold, or base tiles and a running top-k where such a block exceeds the
    budget."""
    q = queries.shape[0]
    n = base.shape[0]
    dev = queries.device
    s = min(SAMPLE_COLUMNS, n // 4)
    sample_k = _sample_rank(k, s, n) if s > 0 else k
    # The sample pays off when it is a small part of the row and its rank a small part of it.
    use_sample = s >= MIN_SAMPLE_COLUMNS and sample_k <= s // 2
    # Per query row of a full block: fp32 distances, the bool mask, the sampled columns and
    # the kept entries (about 2 k int64 keys and their nonzero coordinates).
    per_row = n * 5 + width * 4 + 64 * max(k, 1)
    tq = min(q, 4096, max(1, (budget - n * width * 4) // per_row))
    if tq >= min(q, _MIN_BLOCK_ROWS):
        ids = None
        if use_sample:
            # Base rows in a fixed random order: the block's first columns are then a random
            # sample (whatever order the base has, e.g. sorted by class), read without a gather.
            g = torch.Generator().manual_seed(0)
            ids = torch.randperm(n, generator=g).to(dev)
        ba = _augment(base if ids is None else base[ids], width, query_side=False)
        buf = torch.empty(tq, n, dtype=torch.float32, device=dev)
        for q0 in range(0, q, tq):
            qa = _augment(queries[q0:q0 + tq], width, query_side=True)
            block = buf[:qa.shape[0]]
            distance_tile(qa, ba, block)
            dist, idx = _knn_block(block, k, s if use_sample else 0, sample_k, ids)
            yield q0, dist, idx
        return
    yield from _iter_knn_tiled(queries, base, k, budget, width)


def cpu_tile_sizes(q: int, n: int, k: int, budget: int) -> Tuple[int, int, int]:
    """(query rows, base rows, keys per row) of the compiled CPU path: tiles of at most
    QUERY_TILE x BASE_TILE, shrunk (query rows first, then base rows) until the distance tile
    and the selection state, ``tq * (tb * 4 + cap * 8 + k * 12)`` bytes, fit in ``budget``."""
    cap = k + max(k, 64)
    tq = max(1, min(q, QUERY_TILE))
    tb = max(1, min(n, BASE_TILE))
    while tq > 1 and tq * (tb * 4 + cap * 8 + k * 12) > budget:
        tq = max(1, tq // 2)
    while tb > 1 and tq * (tb * 4 + cap * 8 + k * 12) > budget:
        tb = max(1, tb // 2)
    return tq, tb, cap


def symmetric_block(n: int, k: int, budget: int) -> int:
    """Points per square block S of the symmetric self-search, or 0 when it does not fit.

    Its working set is the selection state of ALL n points (``cap = k + max(k, 64)`` uint64
    keys, a count and a worst key each), one (S, S) fp32 distance tile and one block's (S, k)
    results: ``n * (cap * 8 + 16) + S * (S * 4 + k * 12)`` bytes, kept within ``budget`` (the
    blockwise path's bound: 256 MiB on the CPU by default, 1 GiB in the evaluation metrics) by
    halving S from SYM_BLOCK down to SYM_MIN_BLOCK; 0 (the blockwise path) when even that does
    not fit. E.g. n = 1e5, k = 101: 163 MB of state + 17 MB tile at S = 2048 (fits 256 MiB);
    the metrics at n = 150,000, k = 1,500: 3.6 GB of state, blockwise.
    """
    cap = k + max(k, 64)
    s = max(1, min(n, SYM_BLOCK))
    floor = min(s, SYM_MIN_BLOCK)
    state = n * (cap * 8 + 16)
    while s > floor and state + s * (s * 4 + k * 12) > budget:
        s = max(floor, s // 2)
    return s if state + s * (s * 4 + k * 12) <= budget else 0


def _iter_knn_symmetric(x: Tensor, k: int, width: int, s: int, sel, exclude_self: bool,
                        out: Optional[Tuple[Tensor, Tensor]] = None
                        ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Self-search of the (N, D) points ``x`` (queries = base) with the compiled selection:
    only the tiles (I, J), J >= I, of square blocks of ``s`` points get a GEMM (about half the
    FLOPs of the blockwise path). Tile (I, J) feeds block I's rows (its columns are their
    candidates) and, off the diagonal, block J's rows (its rows, read down each column in C++:
    ``nnk_knn_select_sym``). Yields ``(row0, (rows, k) distances, (rows, k) indices)`` per
    block, in ascending row order; (rows, k - 1) without each point's own index with
    ``exclude_self``.

    Order (the selection's prefilter needs every point's candidates in ascending index order):
    with I outer and J inner, a point of block P receives block 0 .. P-1 from the column sides
    of tiles (0, P) .. (P-1, P) (outer iterations before P), then block P from the diagonal
    tile (P, P) (its row side only: the square tile holds both orders of each pair, so the
    column side would feed every pair twice), then blocks P+1 .. from the row sides of
    (P, P+1) ..; within a tile the candidates ascend along the row (row side) or down the
    column (column side). After outer iteration P nothing more reaches block P: it is final.

    The distance of a pair (i, j), i in block I < J, is the one computed with x_i on the query
    side, for both points' lists: it can differ by a rounding error from the one the blockwise
    path computes for row j (x_j on the query side); each list is still exact by (distance,
    index) for the distances computed.
    """
    n = x.shape[0]
    ba = _augment(x, width, query_side=False)
    buf = torch.empty(s * s, dtype=torch.float32)
    sel.reset(n)
    for i0 in range(0, n, s):
        qa = _augment(x[i0:i0 + s], width, query_side=True)
        rows = qa.shape[0]
        for j0 in range(i0, n, s):
            cols = min(s, n - j0)
            tile = buf[:rows * cols].view(rows, cols)
            distance_tile(qa, ba[j0:j0 + cols], tile)
            sel.add_symmetric(tile, i0, j0)
        dist, idx = sel.finish(i0, rows, self0=i0 if exclude_self else None,
                               out=_rows_of(out, i0, rows))
        yield i0, dist, idx


def _rows_of(out: Optional[Tuple[Tensor, Tensor]], row0: int, rows: int):
    """Rows row0 .. row0 + rows - 1 of the caller's result ``out`` (None: no result given)."""
    return None if out is None else (out[0][row0:row0 + rows], out[1][row0:row0 + rows])


def decoded_into(out: Tuple[Tensor, Tensor], row0: int, dist: Tensor, idx: Tensor) -> bool:
    """Whether the block (row0, dist, idx) that :func:`iter_knn_torch` yielded is already
    the rows of ``out`` (the compiled selection decoded it there) rather than a block of its
    own to copy in."""
    return (dist.data_ptr() == out[0][row0].data_ptr()
            and idx.data_ptr() == out[1][row0].data_ptr())


def _compiled_selection(rows: int, k: int, cap: int):
    from ...ops import cpu  # the compiled library (built on first use) or None
    return cpu.knn_selection(rows, k, cap)


def _iter_knn_compiled(queries: Tensor, base: Tensor, k: int, width: int, tq: int, tb: int,
                       sel, exclude_self: bool, out: Optional[Tuple[Tensor, Tensor]] = None
                       ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """CPU with the compiled library: (tq, tb) distance tiles, each folded into the per-row
    selection in C++ (nnkloss/ops/cpu_kernel.cpp) straight after its GEMM, while it is in
    cache. Lists of k, or k - 1 without each query's own index with ``exclude_self`` (query
    row i is base row i)."""
    q = queries.shape[0]
    n = base.shape[0]
    ba = _augment(base, width, query_side=False)
    buf = torch.empty(tq * tb, dtype=torch.float32)
    for q0 in range(0, q, tq):
        qa = _augment(queries[q0:q0 + tq], width, query_side=True)
        rows = qa.shape[0]
        sel.reset(rows)
        for b0 in range(0, n, tb):
            cols = min(tb, n - b0)
            tile = buf[:rows * cols].view(rows, cols)  # contiguous whatever the tile's shape
            distance_tile(qa, ba[b0:b0 + cols], tile)
            sel.add(tile, b0)
        dist, idx = sel.finish(self0=q0 if exclude_self else None, out=_rows_of(out, q0, rows))
        yield q0, dist, idx


def _iter_knn_tiled(queries: Tensor, base: Tensor, k: int, budget: int, width: int
                    ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Base tiled too (huge N or a tiny budget): a running top-k over (distance, index) keys.
    Exact: every member of the global top-k is in the top-k of its own tile."""
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
        best = best.sort(dim=1).values
        dist, idx = _unkey(best)
        yield q0, dist, idx


def knn_torch(queries: Tensor, base: Tensor, k: int, tile_bytes: Optional[int] = None
              ) -> Tuple[Tensor, Tensor]:
    """(Q, k) fp32 distances and int64 indices of the k nearest base rows of every query."""
    q = queries.shape[0]
    out_d = torch.empty(q, k, dtype=torch.float32, device=queries.device)
    out_i = torch.empty(q, k, dtype=torch.long, device=queries.device)
    for q0, dist, idx in iter_knn_torch(queries, base, k, tile_bytes):
        out_d[q0:q0 + dist.shape[0]] = dist
        out_i[q0:q0 + idx.shape[0]] = idx
    return out_d, out_i
