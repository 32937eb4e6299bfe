"""The bank of centres and what keeps it current: :class:`CentreBank`, the neighbour search
(:mod:`.search`), the :class:`Refresher`, bank files (:mod:`.checkpoint`), centroid banks
(:mod:`.centroids`) and the refresh under ``torch.distributed`` (:mod:`.exchange`)."""
from .centre_bank import CentreBank
from .checkpoint import load_bank, save_bank
from .refresh import Refresher, RefreshSchedule, RefreshStats
from .search import knn, neighbour_lists

__all__ = ["CentreBank", "load_bank", "save_bank", "Refresher", "RefreshSchedule",
           "RefreshStats", "knn", "neighbour_lists"]
