"""nnkloss: nearest-neighbour Gaussian kernel loss with fused Triton kernels.

    bank = nnkloss.CentreBank(centres, labels, neighbours=lists)
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=10.0)(emb, labels, idx)
"""
from .bank import CentreBank
from .checks import set_value_checks, value_checks
from .functional import LossOutput, neighbour_kernel_loss, neighbour_kernel_loss_with_stats
from .loss import NeighbourKernelLoss

__version__ = "0.1.0"

__all__ = [
    "CentreBank",
    "NeighbourKernelLoss",
    "LossOutput",
    "neighbour_kernel_loss",
    "neighbour_kernel_loss_with_stats",
    "set_value_checks",
    "value_checks",
]
