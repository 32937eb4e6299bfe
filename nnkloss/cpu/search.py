"""The exact kNN search's compiled parts (nnkloss/bank/search/torch_search.py): the GEMM of its
distance tiles, the top-k selection folded in straight after, the rows' sort and decode, and
the refresh's list overlap.
"""
from __future__ import annotations

import numbers
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from . import build
from .build import INDEX_TYPES

__all__ = ["KnnSelection", "knn_selection", "gemm_nt", "sort_rows", "list_overlap"]


def list_overlap(new, old, num_rows: int):
    """``(shared, listed)``, each (rows,) int64: how many entries of each list of ``new``
    (rows, K) its list in ``old`` (rows, K') also holds (-1 = padding, never shared; a repeated
    new entry counted each time) and how many are not padding, by the compiled library
    (``nnk_list_overlap``: a bitmap of the ``num_rows`` rows the lists index, O(K) a row);
    None where this is not done here: the library unavailable, non-CPU,
    non-contiguous or non-int32/int64 tensors, lists of different row counts, or an entry
    outside [-1, num_rows).

    ``num_rows`` must be an int >= 0 (TypeError / ValueError naming it): the library sizes its
    bitmap by it, and a negative count became a size_t of 2**64 - n, which aborted the process
    (std::length_error through the C interface); a bitmap too large to allocate is a
    MemoryError naming it."""
    num_rows = _index_arg("num_rows", num_rows)
    if (not (new.is_cpu and old.is_cpu) or new.dtype not in INDEX_TYPES
            or old.dtype not in INDEX_TYPES or new.dim() != 2 or old.dim() != 2
            or new.shape[0] != old.shape[0]
            or not (new.is_contiguous() and old.is_contiguous())):
        return None
    lib = build.lib()
    if lib is None:
        return None
    rows = new.shape[0]
    out = torch.empty(2, rows, dtype=torch.int64)
    rc = lib.nnk_list_overlap(new.data_ptr(), INDEX_TYPES[new.dtype], new.shape[1],
                              old.data_ptr(), INDEX_TYPES[old.dtype], old.shape[1], rows,
                              num_rows, out[0].data_ptr(), out[1].data_ptr())
    if rc == 4:
        raise MemoryError(f"list_overlap: no memory for a bitmap of num_rows={num_rows} rows "
                          f"({(num_rows + 7) // 8} bytes)")
    return (out[0], out[1]) if rc == 0 else None


class KnnSelection:
    """The exact search's selection state for ``rows`` query rows (nnkloss/bank/search/
    torch_search.py): per row a buffer of ``cap`` uint64 keys ``(distance bits << 32) | index``,
    its fill count and the worst key kept at the last compaction; see csrc/search.cpp.
    For a symmetric self-search the rows are all N points of the set (:meth:`add_symmetric`).
    """

    def __init__(self, lib, rows: int, k: int, cap: int):
        self.lib, self.k, self.cap = lib, int(k), int(cap)
        self.keys = torch.empty(rows, self.cap, dtype=torch.int64)
        self.count = torch.empty(rows, dtype=torch.int64)
        self.worst = torch.empty(rows, dtype=torch.int64)
        # No row is live before reset(): the buffers above are uninitialised, and an add()
        # on them would write keys at the garbage counts' offsets.
        self.rows = 0
        self._col_end = 0

    def reset(self, rows: int) -> None:
        """Start a selection of ``rows`` query rows (at most the rows allocated)."""
        rows = _index_arg("rows", rows)
        if not 0 <= rows <= self.keys.shape[0]:
            raise ValueError(f"rows must be in [0, {self.keys.shape[0]}] (the rows the state "
                             f"was allocated for), got {rows}")
        self.rows = rows
        self._col_end = 0
        self.count[:rows].zero_()
        self.worst[:rows].fill_(-1)  # UINT64_MAX: nothing kept yet

    def add(self, dist, col0: int) -> None:
        """Fold a (rows, cols) fp32 CPU tile of distances to base rows col0.. in: ``rows`` the
        rows of the last :meth:`reset`, unit column stride (row stride >= cols), tiles in
        ascending, non-overlapping column order, col0 + cols <= 2**32 (a key's index)."""
        # The library writes each tile row's keys into the state's row of that number and
        # reads rows * row stride floats from dist's pointer: a tile of more rows than the
        # state, of another dtype or device, or with strided columns would write past the
        # state's buffers or read past (or around) the tile's.
        _check_tile(dist, self.rows)
        rows, cols = dist.shape
        col0 = _index_arg("col0", col0)
        if col0 < self._col_end or col0 + cols > 1 << 32:
            # earlier columns would break the prefilter's ascending-index rule (and repeat
            # keys); indices past 2**32 do not fit a key's low half
            raise ValueError(f"col0 must be in [{self._col_end}, 2**32 - {cols}] (after the "
                             f"previous tile's columns; a key holds a 32-bit index), got {col0}")
        self._col_end = col0 + cols
        rc = self.lib.nnk_knn_select(
            dist.data_ptr(), rows, cols, dist.stride(0), int(col0), self.k, self.cap,
            self.keys.data_ptr(), self.count.data_ptr(), self.worst.data_ptr(),
            build.threads(rows * cols))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_select failed (code {rc})")

    def add_symmetric(self, dist, row0: int, col0: int) -> None:
        """Fold the (rows, cols) fp32 CPU tile (row stride ``dist.stride(0)``, unit column
        stride) of distances between points row0.. (query side) and col0.. (base side) of one
        point set into the rows' selections and, unless it is a diagonal tile (row0 == col0,
        rows == cols), into the columns' (``nnk_knn_select_sym``): the caller passes tiles so
        that every point's candidates arrive in ascending index order."""
        _check_tile(dist)
        rows, cols = dist.shape
        row0, col0 = _index_arg("row0", row0), _index_arg("col0", col0)
        if max(row0 + rows, col0 + cols) > self.rows:
            raise ValueError(f"tile rows {row0}..{row0 + rows} / columns {col0}..{col0 + cols} "
                             f"exceed the {self.rows} points of the state")
        rc = self.lib.nnk_knn_select_sym(
            dist.data_ptr(), rows, cols, dist.stride(0), int(row0), int(col0), self.k,
            self.cap, self.keys.data_ptr(), self.count.data_ptr(), self.worst.data_ptr(),
            build.threads(2 * rows * cols))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_select_sym failed (code {rc})")

    def finish(self, row0: int = 0, rows: Optional[int] = None, self0: Optional[int] = None,
               out=None):
        """(rows, k) fp32 distances and int64 indices of state rows row0 .. row0 + rows - 1
        (default: all the rows of the last reset), ascending by (distance, index).

        ``self0``: the rows are points ``self0 ..`` of a self-search (the state selected
        ``k`` = the list length + 1): each row's own index leaves its list in the decode,
        as :func:`nnkloss.bank.search.drop_self` would take it out (the same result), and the
        lists are (rows, k - 1).

        The rows' buffers are padded past their counts with the largest key
        (``nnk_knn_pad``), sorted whole in place (:func:`sort_rows`: numpy's sort), and their
        first k keys decoded (``nnk_knn_unkey``). Keys are unique, so any sort gives the same
        lists; numpy's is SIMD on x86 (x86-simd-sort, AVX2 / AVX-512) and aarch64, several times
        faster than a partial selection in C++ (docs/PERFORMANCE.md, "The CPU library's
        build-time choices"). The state's rows are left sorted and padded: finish them once.

        ``out``: a (distances, indices) pair of contiguous (rows, k) fp32 / int64 CPU tensors
        (k - 1 columns with ``self0``) to decode into, e.g. rows of the caller's whole result:
        no block of its own then, and no copy of it (returned as given)."""
        rows = self.rows - row0 if rows is None else int(rows)
        if row0 < 0 or rows < 0 or row0 + rows > self.rows:
            raise ValueError(f"rows {row0}..{row0 + rows} outside the state's {self.rows}")
        if self0 is not None and (self0 < 0 or self.k < 2):
            raise ValueError(f"self0 must be >= 0 with a selection of k >= 2, got self0 "
                             f"{self0} and k {self.k}")
        k = self.k if self0 is None else self.k - 1
        keys = self.keys[row0:row0 + rows]
        rc = self.lib.nnk_knn_pad(rows, self.k, self.cap, keys.data_ptr(),
                                  self.count[row0:].data_ptr(),
                                  build.threads(rows * self.cap))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_pad failed (code {rc}): a row holds fewer than k "
                               "keys")
        if out is None:
            dist = torch.empty(rows, k, dtype=torch.float32)
            idx = torch.empty(rows, k, dtype=torch.int64)
        else:
            dist, idx = out
            for t, dt in ((dist, torch.float32), (idx, torch.int64)):
                if (t.shape != (rows, k) or t.dtype != dt or t.device.type != "cpu"
                        or not t.is_contiguous()):
                    raise ValueError(f"out must hold contiguous ({rows}, {k}) fp32 and int64 "
                                     f"CPU tensors, got {tuple(t.shape)} {t.dtype} on "
                                     f"{t.device}")
        sort_rows(keys.numpy().view(np.uint64))
        rc = self.lib.nnk_knn_unkey(rows, k, self.cap, keys.data_ptr(), dist.data_ptr(),
                                    idx.data_ptr(), -1 if self0 is None else int(self0),
                                    build.threads(rows * k))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_unkey failed (code {rc})")
        return dist, idx


def _index_arg(name: str, v) -> int:
    """``v`` as an int >= 0, or TypeError / ValueError naming ``name``: it becomes a pointer
    offset in the library."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def _check_tile(dist, rows: Optional[int] = None) -> None:
    """A distance tile the selection's library may read through its pointer: a 2-D fp32 CPU
    tensor with unit column stride and a row stride of at least its columns (the library
    reads row r at r * stride(0)), of ``rows`` rows where given."""
    if not isinstance(dist, torch.Tensor):
        raise TypeError(f"dist must be a tensor, got {type(dist).__name__}")
    if dist.dim() != 2:
        raise ValueError(f"dist must be a 2-D (rows, cols) tile, got shape {tuple(dist.shape)}")
    r, c = dist.shape
    if (dist.dtype != torch.float32 or dist.device.type != "cpu"
            or (c > 1 and dist.stride(1) != 1) or (r > 1 and dist.stride(0) < c)):
        raise ValueError(f"dist must be an fp32 CPU tile with unit column stride and a row "
                         f"stride >= its columns, got {dist.dtype} on {dist.device}, strides "
                         f"{tuple(dist.stride())}")
    if rows is not None and r != rows:
        raise ValueError(f"dist has {r} rows but the selection was reset to {rows} rows")


def sort_rows(a) -> None:
    """Sort each row of the 2-D numpy array ``a`` in place, the rows shared out to torch's
    thread count where each thread gets at least SORT_MIN_KEYS: numpy's sort (which releases
    the GIL) called back from the library's threads (``nnk_run_items``, torch's OpenMP team),
    or from Python threads where the library is unavailable. Python threads straight after one
    of the team's parallel regions (the search's GEMM and selection) would share the cores with
    its workers, which spin for milliseconds."""
    n_rows, width = a.shape
    n = min(build.threads(n_rows * width, SORT_MIN_KEYS), max(n_rows, 1))
    if n == 1:
        a.sort(axis=1)
        return
    bounds = [n_rows * t // n for t in range(n + 1)]
    lib = build.lib()
    if lib is None:
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda t: a[bounds[t]:bounds[t + 1]].sort(axis=1), range(n)))
        return
    errors = []

    def share(t):  # an exception cannot cross the C frames: kept, raised below
        try:
            a[bounds[t]:bounds[t + 1]].sort(axis=1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    rc = lib.nnk_run_items(n, n, build.ITEM_CALLBACK(share))
    if errors:
        raise errors[0]
    if rc != 0:
        raise RuntimeError(f"nnk_run_items failed (code {rc})")


# Keys a sorting thread gets at least (well above the cost of a thread's start).
SORT_MIN_KEYS = 1 << 16


def gemm_nt(a, b, out, nthreads: Optional[int] = None) -> bool:
    """``out = a @ b.T`` by the library's GEMM (``nnk_gemm_nt`` in csrc/search.cpp: each element
    one fp32 dot product summed in column order with fused multiply-adds, the same bits whatever
    the shapes and threads), for fp32 CPU matrices with unit column strides, ``out`` (m, n) not
    overlapping the inputs. True when it ran; False where it cannot (the library unavailable or
    built without AVX-512, or another dtype, device or layout): the caller then uses torch.mm.
    Threads: :func:`nnkloss.cpu.build.threads`'s, or exactly ``nthreads``.
    """
    lib = build.lib()
    mats = (a, b, out)
    if (lib is None or any(t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2
                           for t in mats)
            or a.shape[1] != b.shape[1] or out.shape != (a.shape[0], b.shape[0])):
        return False
    lds = [_row_stride(t) for t in mats]
    if None in lds:
        return False
    m, k = a.shape
    n = b.shape[0]

    def call(t):
        return lib.nnk_gemm_nt(a.data_ptr(), lds[0], b.data_ptr(), lds[1], out.data_ptr(),
                               lds[2], m, n, k, t)
    rc = call(max(1, int(nthreads)) if nthreads is not None
              else build.threads(m * n * max(k, 1), GEMM_MIN_MACS))
    if rc == 1:
        return False
    if rc != 0:
        raise RuntimeError(f"nnk_gemm_nt failed (code {rc})")
    return True


def _row_stride(t) -> Optional[int]:
    """The row stride of a 2-D tensor whose rows are unit-stride and do not overlap (what the
    library's GEMM reads and writes), or None."""
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1:
        return None
    if rows <= 1:
        return max(cols, 1)
    return t.stride(0) if t.stride(0) >= max(cols, 1) else None


# A GEMM thread's least share of multiply-adds (microseconds of work), below which a parallel
# region would not repay itself.
GEMM_MIN_MACS = 1 << 20


def knn_selection(rows: int, k: int, cap: int) -> Optional[KnnSelection]:
    """A compiled selection state for ``rows`` query rows, or None when the library is
    unavailable (the search then runs its plain torch selection)."""
    lib = build.lib()
    return None if lib is None else KnnSelection(lib, rows, k, cap)
