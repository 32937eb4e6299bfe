"""Choosing the kernel width sigma before training, by validation loss: on fixed embeddings
the mean kernel loss is smallest at a sigma matched to the scale of the distances
(``NeighbourKernelLoss(learn_sigma=True)`` is the alternative).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Tuple

import torch
from torch import Tensor, nn

from ..inference import inference_model, to_device
from ..losses.base import BankLoss
from ..validation import require_sigma

__all__ = ["choose_sigma"]


@torch.no_grad()
def choose_sigma(model: nn.Module, criterion: nn.Module, loader: Iterable, candidates,
                 device="cpu") -> Tuple[float, Dict[float, float]]:
    """Pick the kernel width with the lowest mean kernel loss on validation data, no training.

    Args:
        model: the embedding network, run once over ``loader`` in eval mode (modes restored).
        criterion: a :class:`nnkloss.NeighbourKernelLoss` whose bank already holds centres and
            lists for every ``idx`` the loader yields (typically the validation set embedded
            by a :class:`nnkloss.Refresher`).
        loader: yields ``(inputs, labels, idx)``, idx the bank rows.
        candidates: the sigmas to try (positive finite floats; order breaks ties).
        device: where ``inputs`` go for the model.

    Returns:
        ``(best_sigma, {sigma: mean_loss})``, the mean over all counted rows of the loader; a
        NaN mean is never chosen. The criterion's sigma is restored, its bank unchanged.
    """
    if not isinstance(criterion, BankLoss) or not isinstance(getattr(criterion, "log_sigma", None),
                                                              Tensor):
        raise TypeError(f"criterion must be a kernel loss with a log_sigma over a bank "
                        f"(nnkloss.NeighbourKernelLoss), got {type(criterion).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"loader must be an iterable of (inputs, labels, idx), got "
                        f"{type(loader).__name__}")
    if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__"):
        raise TypeError(f"candidates must be an iterable of positive floats, got "
                        f"{type(candidates).__name__}")
    sigmas = [require_sigma(c, f"candidates[{i}]") for i, c in enumerate(candidates)]
    if not sigmas:
        raise ValueError("candidates is empty: give at least one sigma to try")
    device = torch.device(device)
    bank_device = criterion.bank.centres.device

    # Embed once: the embeddings do not depend on sigma.
    batches = []
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        net = inference_model(model)
        for batch in loader:
            if not isinstance(batch, (tuple, list)) or len(batch) != 3:
                raise ValueError("loader must yield (inputs, labels, idx) triples")
            inputs, labels, idx = batch
            emb = net(to_device(inputs, device))
            batches.append((emb.detach().float().to(bank_device),
                            torch.as_tensor(labels).to(bank_device),
                            torch.as_tensor(idx).to(bank_device)))
    finally:
        for m, was_training in modes:
            m.training = was_training
    if not batches:
        raise ValueError("loader yielded no batches")

    log_sigma = criterion.log_sigma
    saved = log_sigma.detach().clone()
    saved_stats = criterion.last_stats
    losses: Dict[float, float] = {}
    try:
        for sigma in sigmas:
            log_sigma.copy_(torch.tensor(math.log(sigma), dtype=log_sigma.dtype))
            total = torch.zeros((), dtype=torch.float64, device=bank_device)
            counted = torch.zeros((), dtype=torch.int64, device=bank_device)
            for emb, labels, idx in batches:
                criterion(emb, labels, idx)
                stats = criterion.last_stats
                total += stats.per_row.double().masked_fill(~stats.counted, 0.0).sum()
                counted += stats.counted.sum()
            n = int(counted)
            if n == 0:
                raise ValueError("no validation row has a same-class neighbour in its list: "
                                 "the loss is undefined for every sigma (check the bank's "
                                 "lists, k and the loader's idx)")
            losses[sigma] = float(total) / n
    finally:
        log_sigma.copy_(saved)
        criterion.last_stats = saved_stats
    finite = [s for s in sigmas if math.isfinite(losses[s])]
    if not finite:
        raise ValueError(f"no candidate sigma gives a finite validation loss: {losses}")
    return min(finite, key=losses.__getitem__), losses  # min keeps the first of equal losses
