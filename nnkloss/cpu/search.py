"""The exact kNN search's compiled parts (nnkloss/bank/search/torch_search.py): its tiles'
GEMM, the top-k selection, the rows' sort and decode, and the refresh's list overlap.
"""
from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch

from . import build
from .build import INDEX_TYPES

__all__ = ["KnnSelection", "knn_selection", "gemm_nt", "sort_rows", "list_overlap"]


def list_overlap(new, old, num_rows: int):
    """``(shared, listed)``, each (rows,) int64: how many entries of each list of ``new``
    (rows, K) its list in ``old`` (rows, K') also holds (-1 = padding, never shared; a repeated
    new entry counted each time) and how many are not padding. None where the library does not
    take the tensors or an entry is outside [-1, num_rows), ``num_rows`` an int >= 0 (a bitmap
    too large to allocate: MemoryError)."""
    num_rows = _index_arg("num_rows", num_rows)
    lib = build.lib()
    if (lib is None or not (new.is_cpu and old.is_cpu) or new.dtype not in INDEX_TYPES
            or old.dtype not in INDEX_TYPES or new.dim() != 2 or old.dim() != 2
            or new.shape[0] != old.shape[0]
            or not (new.is_contiguous() and old.is_contiguous())):
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
    """The exact search's selection state for ``rows`` query rows: per row a buffer of ``cap``
    uint64 keys ``(distance bits << 32) | index``, its fill count and the worst key kept at the
    last compaction (csrc/search.cpp). A symmetric self-search has a row per point."""

    def __init__(self, lib, rows: int, k: int, cap: int):
        self.lib, self.k, self.cap = lib, int(k), int(cap)
        self.keys = torch.empty(rows, self.cap, dtype=torch.int64)
        self.count = torch.empty(rows, dtype=torch.int64)
        self.worst = torch.empty(rows, dtype=torch.int64)
        self.rows = 0  # no row is live before reset(): the buffers are uninitialised
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
        _check_tile(dist, self.rows)
        rows, cols = dist.shape
        col0 = _index_arg("col0", col0)
        if col0 < self._col_end or col0 + cols > 1 << 32:
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
        """Fold the (rows, cols) fp32 CPU tile of distances between points row0.. and col0.. of
        one point set into the rows' selections and, off the diagonal, into the columns': the
        caller passes tiles so that every point's candidates arrive in ascending index order."""
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

        ``self0``: the rows are points ``self0 ..`` of a self-search that selected k = the list
        length + 1: each row's own index leaves its list (as ``drop_self`` would), giving
        (rows, k - 1). ``out``: contiguous fp32 / int64 CPU tensors of that shape to decode into,
        returned as given. The buffers are left sorted and decoded: finish them once."""
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
            out = torch.empty(rows, k, dtype=torch.float32), torch.empty(rows, k, dtype=torch.int64)
        dist, idx = out
        for t, dt in ((dist, torch.float32), (idx, torch.int64)):
            if t.shape != (rows, k) or t.dtype != dt or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"out must hold contiguous ({rows}, {k}) fp32 and int64 CPU "
                                 f"tensors, got {tuple(t.shape)} {t.dtype} on {t.device}")
        sort_rows(keys.numpy().view(np.uint64))
        rc = self.lib.nnk_knn_unkey(rows, k, self.cap, keys.data_ptr(), dist.data_ptr(),
                                    idx.data_ptr(), -1 if self0 is None else int(self0),
                                    build.threads(rows * k))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_unkey failed (code {rc})")
        return dist, idx


def _index_arg(name: str, v) -> int:
    """``v`` as an int >= 0 (a pointer offset in the library), else TypeError / ValueError
    naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def _check_tile(dist, rows: Optional[int] = None) -> None:
    """Raise unless ``dist`` is a tile the library may read (of ``rows`` rows where given)."""
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
    """Sort each row of the 2-D numpy array ``a`` in place: numpy's sort (it releases the GIL)
    on shares of at least SORT_MIN_KEYS keys, called back from the library's threads (torch's
    team, whose workers would spin beside Python threads)."""
    n_rows, width = a.shape
    n = min(build.threads(n_rows * width, SORT_MIN_KEYS), max(n_rows, 1))
    lib = build.lib()
    if n == 1 or lib is None:
        a.sort(axis=1)
        return
    bounds = [n_rows * t // n for t in range(n + 1)]
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
    """``out = a @ b.T`` by the library's GEMM (each element one fp32 dot product in column
    order: the same bits whatever the shapes and threads) for fp32 CPU matrices with unit
    column strides, ``out`` not overlapping them; ``nthreads`` exactly, else build.threads'.
    False where it cannot run (no library or AVX-512, another dtype, device or layout)."""
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
    t = (max(1, int(nthreads)) if nthreads is not None
         else build.threads(m * n * max(k, 1), GEMM_MIN_MACS))
    rc = lib.nnk_gemm_nt(a.data_ptr(), lds[0], b.data_ptr(), lds[1], out.data_ptr(), lds[2],
                         m, n, k, t)
    if rc == 1:
        return False
    if rc != 0:
        raise RuntimeError(f"nnk_gemm_nt failed (code {rc})")
    return True


def _row_stride(t) -> Optional[int]:
    """The row stride of a 2-D tensor whose rows are unit-stride and do not overlap, or None."""
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1:
        return None
    if rows <= 1:
        return max(cols, 1)
    return t.stride(0) if t.stride(0) >= max(cols, 1) else None


# A GEMM thread's least share of multiply-adds.
GEMM_MIN_MACS = 1 << 20


def knn_selection(rows: int, k: int, cap: int) -> Optional[KnnSelection]:
    """A compiled selection state, or None without the library (the search then runs torch's)."""
    lib = build.lib()
    return None if lib is None else KnnSelection(lib, rows, k, cap)
