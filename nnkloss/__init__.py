"""nnkloss: nearest-neighbour Gaussian kernel loss with fused Triton kernels.

    bank = nnkloss.CentreBank(centres, labels, neighbours=lists)
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=10.0)(emb, labels, idx)
"""
from .bank import CentreBank
from .checks import set_value_checks, value_checks
from .functional import LossOutput, neighbour_kernel_loss, neighbour_kernel_loss_with_stats
from .loss import NeighbourKernelLoss
from . import search  # neighbour search: knn, neighbour_lists, recall_against_exact
from .search import knn
from .refresh import Refresher, RefreshSchedule, RefreshStats
from .checkpoint import load_bank, save_bank
from . import distributed  # torch.distributed: init_from_env, sync_loss_parameters, ...
from . import metrics
from . import plots
from .ccml import ClassConditionalLoss, class_conditional_loss
from .classifier import NeighbourKernelClassifier

__version__ = "0.1.0"

__all__ = [
    "CentreBank",
    "NeighbourKernelLoss",
    "LossOutput",
    "neighbour_kernel_loss",
    "neighbour_kernel_loss_with_stats",
    "set_value_checks",
    "value_checks",
    "knn",
    "search",
    "Refresher",
    "RefreshSchedule",
    "RefreshStats",
    "save_bank",
    "load_bank",
    "NeighbourKernelClassifier",
    "ClassConditionalLoss",
    "class_conditional_loss",
    "metrics",
    "plots",
]
