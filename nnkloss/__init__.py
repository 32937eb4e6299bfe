"""nnkloss: nearest-neighbour Gaussian kernel loss with fused Triton kernels.

    bank = nnkloss.CentreBank(centres, centre_labels, neighbours=lists)
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=10.0)(emb, labels, idx)

The package, by layer (each imports only the ones above it):

- ``nnkloss.ops``: the op -- one autograd definition, the functional API, and the interface
  of its passes with one implementation per backend (the Triton kernels are ``kernels/`` at
  the repository's top, installed as ``nnkloss.kernels``; the plain PyTorch reference is
  ``nnkloss.ops.reference``);
- ``nnkloss.distributed``: the ``torch.distributed`` runtime (process group, sharded loaders,
  DDP helpers), a no-op in a single process;
- ``nnkloss.bank``: :class:`CentreBank`, neighbour search, refresh, checkpoints, centroids,
  the bank's exchange under ``torch.distributed``;
- ``nnkloss.losses``: losses over a bank (:class:`BankLoss` and its subclasses);
- ``nnkloss.evaluation``: the kernel classifier and retrieval metrics;
- ``nnkloss.experiment``: the kit of the reproduction scripts (data sets, models, Trainer,
  plots, reporting), imported only on demand.
"""
import importlib

from . import distributed
from .bank.centre_bank import CentreBank
from .bank.checkpoint import load_bank, save_bank
from .bank.refresh import Refresher, RefreshSchedule, RefreshStats
from .bank.search import knn
from .evaluation import metrics
from .evaluation.classifier import NeighbourKernelClassifier
from .losses import BankLoss, ClassConditionalLoss, NeighbourKernelLoss, class_conditional_loss
from .ops import LossOutput, neighbour_kernel_loss, neighbour_kernel_loss_with_stats
from .validation import value_checks

__version__ = "0.1.0"


def __getattr__(name):
    # The experiment kit (matplotlib, torchvision, ...) is imported on first use, so that
    # ``import nnkloss`` stays light.
    if name == "experiment":
        module = importlib.import_module("nnkloss.experiment")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'nnkloss' has no attribute {name!r}")


__all__ = [
    "CentreBank",
    "BankLoss",
    "NeighbourKernelLoss",
    "LossOutput",
    "neighbour_kernel_loss",
    "neighbour_kernel_loss_with_stats",
    "value_checks",
    "knn",
    "Refresher",
    "RefreshSchedule",
    "RefreshStats",
    "save_bank",
    "load_bank",
    "NeighbourKernelClassifier",
    "metrics",
    "ClassConditionalLoss",
    "class_conditional_loss",
    "distributed",
]
