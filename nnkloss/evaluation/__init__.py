"""Using a trained embedding: the kernel classifier (Eq. 3 / CCKNN) and retrieval metrics
(Recall@K, MAP@R, NMI, accuracy)."""
from . import metrics
from .classifier import NeighbourKernelClassifier

__all__ = ["NeighbourKernelClassifier", "metrics"]
