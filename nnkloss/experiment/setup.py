"""Set-up shared by the reproduction scripts: devices, run settings, image transforms,
loaders, and the kernel-loss criterion (the softmax one is :class:`.models.SoftmaxHead`)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Iterable, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import distributed as nkd
from ..bank.centre_bank import CentreBank
from ..losses.neighbour_kernel import NeighbourKernelLoss
from ..bank.refresh import Refresher
from .reporting import write_json
from .train import CHECKPOINT_NAME

__all__ = ["HelpFormatter", "resolve_device", "image_transforms", "make_loader", "kernel_criterion",
           "run_settings", "check_resume", "check_epochs"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each default once (not where the help names it, nor None or False)."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def resolve_device(name: Optional[str] = None) -> torch.device:
    """``None``/"auto": CUDA when available, else CPU; otherwise the named device, checked
    before any work starts (ValueError / RuntimeError naming ``--device``)."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}"
                         ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {name}: this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def start_run(device_name: Optional[str], out_dir: str) -> torch.device:
    """Resolve the device, join a torchrun job (gloo on the CPU), create ``out_dir``."""
    device = resolve_device(device_name)
    nkd.init_from_env(dist_backend="gloo" if device.type == "cpu" else None)
    os.makedirs(out_dir, exist_ok=True)
    return device


_AGAIN = ": pass --restart to train it afresh, or another --out"
#: Script options that do not change what a run trains (epochs are checked apart).
NOT_SETTINGS = ("out", "data_root", "device", "workers", "no_progress", "restart",
                "embedding_plot", "eval_every", "epochs")


def run_settings(args, **run) -> dict:
    """A run's settings as JSON: ``args`` less :data:`NOT_SETTINGS`, updated with ``run``."""
    out = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS and k not in run}
    out.update(run)
    return json.loads(json.dumps(out))


def check_resume(run_dir: str, settings: dict, restart: bool) -> None:
    """SystemExit naming the differences where ``run_dir`` holds a checkpoint of other
    settings; then record ``settings`` in ``settings.json`` (rank 0). ``restart`` removes the
    old checkpoint first."""
    path = os.path.join(run_dir, "settings.json")
    checkpoint = os.path.join(run_dir, CHECKPOINT_NAME)
    if not restart and os.path.isfile(checkpoint) and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
            raise SystemExit(f"{path} cannot be read as the run's settings ({exc}){_AGAIN}"
                             ) from None
        if not isinstance(old, dict):
            raise SystemExit(f"{path} holds {type(old).__name__}, not the run's settings{_AGAIN}")
        differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if differ:
            raise SystemExit(f"{run_dir} holds a checkpoint trained with other settings ("
                             + ", ".join(f"{k}: {old.get(k)!r}, now {settings.get(k)!r}"
                                         for k in differ) + f"){_AGAIN}")
    if nkd.is_main_process():
        os.makedirs(run_dir, exist_ok=True)
        if restart:
            # Before the new settings: they must never stand beside the old checkpoint.
            with contextlib.suppress(FileNotFoundError):
                os.remove(checkpoint)
        write_json(path, settings)


def check_epochs(trainer, epochs: int) -> None:
    """SystemExit when the Trainer's (resumed) run is past ``epochs``."""
    if trainer.epoch > int(epochs):
        raise SystemExit(f"{trainer.out_dir} holds a checkpoint of {trainer.epoch} epochs, more "
                         f"than --epochs {epochs}{_AGAIN}")


def image_transforms(image_size: int = 224, train: bool = True):
    """torchvision transform: PIL image -> (3, image_size, image_size) float32, normalised.

    Resize to ``round(image_size * 256 / 224)`` square, then a random crop and flip (train) or
    a centre crop (eval), as in the papers at 224.
    """
    from torchvision import transforms as T

    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    resize = int(round(image_size * 256 / 224))
    crop = ([T.RandomCrop(image_size), T.RandomHorizontalFlip()] if train
            else [T.CenterCrop(image_size)])
    return T.Compose([T.Resize((resize, resize)), *crop, T.ToTensor(),
                      T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])  # ImageNet


def make_loader(ds: Dataset, batch_size: int, shuffle: bool, workers: int = 0,
                device: Optional[torch.device] = None, drop_last: bool = False) -> DataLoader:
    """A DataLoader, pinned on CUDA, persistent workers; no ``generator`` (the Trainer reseeds
    the global RNG per epoch)."""
    pin = device is not None and torch.device(device).type == "cuda"
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                      pin_memory=pin, drop_last=drop_last, persistent_workers=workers > 0)


def kernel_criterion(model: nn.Module, ordered_loader: Iterable, labels: torch.Tensor, dim: int,
                     sigma: float, k: int, device, learn_weights: bool = False,
                     learn_sigma: bool = False, progress: bool = True, **refresher_options
                     ) -> Tuple[NeighbourKernelLoss, Refresher]:
    """The kernel loss over a bank of the training set, and the Refresher that fills it.

    Args:
        model: the embedding network.
        ordered_loader: the training set without augmentation, yielding (x, label, idx).
        labels: (N,) labels of the training set (bank row i = item i).
        dim: embedding size D; device: where the bank lives.
        sigma, learn_sigma: as in :class:`NeighbourKernelLoss`; learn_weights: as in
            :class:`CentreBank`.
        k: neighbour-list length, clamped to N - 1.
        progress, refresher_options: for the :class:`Refresher` (ensure_positive,
            search_backend, async_mode, recalibrate_bn, ...).
    Returns:
        (criterion, refresher); the bank starts as zeros until the first refresh.
    """
    device = torch.device(device)
    n = len(labels)
    if n < 2:
        raise ValueError(f"the training set has {n} items; the kernel loss needs at least 2")
    bank = CentreBank(torch.zeros(n, dim, device=device),
                      torch.as_tensor(labels).long().to(device), learn_weights=learn_weights)
    criterion = NeighbourKernelLoss(bank, sigma=sigma, learn_sigma=learn_sigma)
    refresher = Refresher(bank, model, ordered_loader, k=min(int(k), n - 1), device=device,
                          progress=progress, sigma=criterion,  # its current sigma
                          **refresher_options)
    return criterion, refresher
