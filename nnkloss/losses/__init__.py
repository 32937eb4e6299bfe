"""Losses over a :class:`~nnkloss.CentreBank`: one contract (:class:`BankLoss`), each loss only
its maths -- the kernel loss of Eq. 3 and the class-conditional CCML objective."""
from .base import BankLoss
from .ccml import ClassConditionalLoss, class_conditional_loss, class_conditional_loss_rows
from .neighbour_kernel import NeighbourKernelLoss

__all__ = ["BankLoss", "NeighbourKernelLoss", "ClassConditionalLoss", "class_conditional_loss",
           "class_conditional_loss_rows"]
