"""Evaluation helpers of the reproduction scripts: embedding a data set, the papers' retrieval
metrics, and classification accuracy with the kernel classifier or a softmax head."""
from __future__ import annotations

import warnings
from typing import Dict, Iterable, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..evaluation.classifier import NeighbourKernelClassifier
from ..losses.neighbour_kernel import NeighbourKernelLoss
from ..evaluation.metrics import accuracy, evaluate, nmi
from ..inference import inference_model

__all__ = ["extract_embeddings", "retrieval_metrics", "kernel_accuracy", "softmax_accuracy",
           "classification_metrics", "RECALL_KS"]

RECALL_KS = (1, 2, 4, 8)


@torch.no_grad()
def extract_embeddings(model: nn.Module, loader: Iterable, device=None, amp: bool = False,
                       progress: bool = False, desc: str = "embed") -> Tuple[Tensor, Tensor]:
    """Embed every item of a loader yielding ``(inputs, labels, idx)`` with ``model.eval()``.

    Returns ``(emb (N, D) float32, labels (N,) int64)`` on the CPU, row ``i`` the item with
    ``idx == i``. The model's mode is restored; ``amp`` (CUDA only) runs float16 autocast.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device if device is None else torch.device(device)
    was_training = model.training
    model.eval()
    use_amp = bool(amp) and device.type == "cuda"
    embs, labs, idxs = [], [], []
    try:
        net = inference_model(model)
        for x, y, idx in tqdm(loader, desc=desc, disable=not progress, leave=False):
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                e = net(x.to(device, non_blocking=True))
            embs.append(e.float().cpu())
            labs.append(torch.as_tensor(y).long().cpu())
            idxs.append(torch.as_tensor(idx).long().cpu())
    finally:
        model.train(was_training)
    if not embs:
        raise ValueError("the loader yielded no batches")
    emb, lab, idx = torch.cat(embs), torch.cat(labs), torch.cat(idxs)
    n = len(idx)
    if int(idx.min()) < 0 or int(idx.max()) != n - 1 or len(torch.unique(idx)) != n:
        raise ValueError(f"the loader's idx values must be 0..N-1, each once (got {n} items, "
                         f"idx range {int(idx.min())}..{int(idx.max())})")
    order = torch.argsort(idx)  # row i: the item with idx == i
    return emb[order], lab[order]


def retrieval_metrics(emb, labels, ks: Sequence[int] = RECALL_KS, search_backend: str = "auto",
                      seed: int = 0) -> Dict[str, float]:
    """``{"recall@K" for K in ks, "map@r", "r_precision", "nmi"}`` of emb (N, D) with labels
    (N,), from :func:`nnkloss.evaluation.metrics.evaluate` and ``nmi`` (seeded with ``seed``).
    Undefined entries (K > N - 1, no class of two, N < 2) are None, with a warning.
    """
    n = len(labels)
    usable = [k for k in ks if k <= n - 1]
    skipped = [k for k in ks if k > n - 1]
    if skipped:
        warnings.warn(f"the evaluation set has {n} items: Recall@K for K = {skipped} skipped "
                      f"(K must be <= N - 1); reported as None", stacklevel=2)
    counts = torch.unique(torch.as_tensor(labels), return_counts=True)[1] if n else None
    with_map = n >= 2 and int(counts.max()) >= 2
    if n >= 2 and not with_map:
        warnings.warn("no class of the evaluation set has two members: MAP@R and R-precision "
                      "are undefined; reported as None", stacklevel=2)
    res = (evaluate(emb, labels, usable, map_at_r=with_map, search_backend=search_backend)
           if usable or with_map else {})
    out = {key: res.get(key) for key in [f"recall@{k}" for k in ks] + ["map@r", "r_precision"]}
    out["nmi"] = float(nmi(emb, labels, seed=seed)) if n >= 2 else None
    return out


def kernel_accuracy(train_emb: Tensor, train_labels: Tensor, emb: Tensor, labels: Tensor,
                    k: int, sigma: float, weights: Tensor = None) -> float:
    """Accuracy of :class:`NeighbourKernelClassifier` over a bank of the training embeddings."""
    bank = CentreBank(train_emb.float(), train_labels.long(),
                      weights=None if weights is None else weights.detach().float().cpu())
    clf = NeighbourKernelClassifier(bank, k=min(int(k), len(train_labels)), sigma=float(sigma))
    return accuracy(clf.predict(emb.float()), labels)


def nearest_neighbour_accuracy(train_emb: Tensor, train_labels: Tensor, emb: Tensor,
                               labels: Tensor) -> float:
    """Accuracy of the 1-nearest-neighbour classifier (raw pixels: the floor of the scripts)."""
    from ..bank.search import knn
    _, idx = knn(emb.float(), train_emb.float(), 1)
    return accuracy(train_labels[idx[:, 0]], labels)


@torch.no_grad()
def softmax_accuracy(head: nn.Module, emb: Tensor, labels: Tensor) -> float:
    """Accuracy of a softmax head (``head.predict(emb) -> (B,)``) on embeddings (B, D)."""
    dev = next(head.parameters()).device
    return accuracy(head.predict(emb.to(dev)).cpu(), labels)


@torch.no_grad()
def classification_metrics(model: nn.Module, criterion: nn.Module, train_loader: Iterable,
                           loader: Iterable, k: int = 100, device=None, amp: bool = False,
                           progress: bool = False) -> Dict[str, float]:
    """``{"accuracy": .., "loss": ..}`` of a trained model on ``loader``'s items.

    A :class:`NeighbourKernelLoss` classifies with Eq. 3 over a bank of ``train_loader``'s
    current embeddings (its sigma and weights, ``k`` neighbours); a softmax head with its
    logits. ``loss``: the mean negative log-probability of the true class (floored at 1e-12).
    """
    device = next(model.parameters()).device if device is None else torch.device(device)
    emb, labels = extract_embeddings(model, loader, device, amp, progress, desc="embed eval")
    if isinstance(criterion, NeighbourKernelLoss):
        tr_emb, tr_lab = extract_embeddings(model, train_loader, device, amp, progress,
                                            desc="embed train")
        bank = CentreBank(tr_emb.to(device), tr_lab.to(device),
                          weights=criterion.bank.weights.detach().float().to(device))
        clf = NeighbourKernelClassifier(bank, k=min(int(k), len(tr_lab)),
                                        sigma=criterion.kernel_sigma())
        proba = clf.predict_proba(emb.to(device)).cpu()
        if proba.shape[1] < int(labels.max()) + 1:  # classes absent from the training set
            proba = torch.nn.functional.pad(proba, (0, int(labels.max()) + 1 - proba.shape[1]))
    else:
        head_dev = next(criterion.parameters()).device
        proba = torch.softmax(criterion.logits(emb.to(head_dev)), dim=1).cpu()
    p_true = proba.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-12)
    return {"accuracy": accuracy(proba.argmax(1), labels), "loss": float(-p_true.log().mean())}
