"""k-nearest-neighbour search for the neighbour lists, the classifier and the metrics. All
results are ``(distances, neighbours)``: fp32 squared L2 distances ascending, ties ordered by
index, and int64 base rows."""
from .exclusion import drop_self
from .faiss_search import faiss_available, faiss_gpu_usable
from .knn import (APPROXIMATE, SEARCH_BACKENDS, SearchBlock, SearchResult, iter_knn, knn,
                  recall_against_exact, resolve_search_backend)
from .lists import (NeighbourLists, has_same_label, neighbour_lists, patch_positives,
                    synchronize)

__all__ = ["knn", "iter_knn", "SearchResult", "SearchBlock", "recall_against_exact",
           "neighbour_lists", "NeighbourLists",
           "faiss_available", "faiss_gpu_usable", "SEARCH_BACKENDS", "APPROXIMATE",
           "resolve_search_backend", "drop_self", "patch_positives", "has_same_label",
           "synchronize"]
