"""The compiled CPU backend: one C++ library (``csrc/``), built on first use and loaded with
ctypes (:mod:`.build`); the op's passes (:mod:`.op`) and the exact search's GEMM and top-k
selection (:mod:`.search`) call it. Optional: where it is unavailable, its callers run torch.
"""
from .build import available, build_info, library_path
from .op import (batch_lists, centre_grad, entry_grads, entry_grads_supported, forward,
                 forward_exp, gather_lists, gather_read, gathered_rows_finite, has_same_label,
                 rel_sqdist, scale_rows, value_flags)
from .search import KnnSelection, gemm_nt, knn_selection, list_overlap, sort_rows

__all__ = ["available", "build_info", "library_path", "batch_lists", "centre_grad",
           "entry_grads", "entry_grads_supported", "forward", "forward_exp", "gather_lists",
           "gather_read", "gathered_rows_finite", "has_same_label", "rel_sqdist",
           "scale_rows", "value_flags", "KnnSelection", "gemm_nt", "knn_selection",
           "list_overlap", "sort_rows"]
