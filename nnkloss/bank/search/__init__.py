"""k-nearest-neighbour search: for the centres' neighbour lists, the classifier and the metrics.

One job per module:

* :mod:`.validation`: argument checks shared by every entry point;
* :mod:`.exclusion`: :func:`drop_self`, the one self-exclusion rule (search ``k + 1``, drop
  own row; the compiled CPU selection applies it in its decode);
* :mod:`.torch_search`: exact tiled GEMM search with a threshold selection (any device);
* :mod:`.faiss_search`: faiss indexes (exact flat on CPU/GPU, approximate IVF / HNSW);
* :mod:`.knn`: the public :func:`knn` / :func:`iter_knn` and the backend choice;
* :mod:`.lists`: :func:`neighbour_lists` (self excluded, optional positive per row);
* :mod:`.recall`: :func:`recall_against_exact` for approximate indexes.

All results are ``(distances, neighbours)``, in that order (as ``torch.topk`` and faiss return
them): squared L2 distances in ascending order (fp32), equal distances ordered by index, and
int64 base-row indices (:class:`SearchResult`, :class:`SearchBlock`, the first two fields of
:class:`NeighbourLists`).
"""
from .exclusion import drop_self
from .faiss_search import faiss_available, faiss_gpu_usable
from .knn import SearchBlock, SearchResult, iter_knn, knn, resolve_search_backend
from .lists import (NeighbourLists, has_same_label, neighbour_lists, patch_positives,
                    synchronize)
from .recall import recall_against_exact
from .validation import APPROXIMATE, SEARCH_BACKENDS

__all__ = ["knn", "iter_knn", "SearchResult", "SearchBlock", "recall_against_exact",
           "neighbour_lists", "NeighbourLists",
           "faiss_available", "faiss_gpu_usable", "SEARCH_BACKENDS", "APPROXIMATE",
           "resolve_search_backend", "drop_self", "patch_positives", "has_same_label",
           "synchronize"]
