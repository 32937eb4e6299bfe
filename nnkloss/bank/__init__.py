"""The bank of centres and what keeps it current.

- :mod:`.centre_bank`: :class:`CentreBank` (centres, centre_labels, weights, neighbour lists);
- :mod:`.search`: exact / approximate k-nearest-neighbour search (FAISS or tiled torch);
- :mod:`.refresh`: :class:`Refresher` (re-embed, rebuild lists, swap) and its schedule;
- :mod:`.checkpoint`: atomic, validated bank files;
- :mod:`.centroids`: class-mean / k-means banks;
- :mod:`.exchange`: the refresh under ``torch.distributed`` (row exchange, sharded list search).
"""
from .centre_bank import CentreBank
from .checkpoint import load_bank, save_bank
from .refresh import Refresher, RefreshSchedule, RefreshStats
from .search import knn, neighbour_lists

__all__ = ["CentreBank", "load_bank", "save_bank", "Refresher", "RefreshSchedule",
           "RefreshStats", "knn", "neighbour_lists"]
