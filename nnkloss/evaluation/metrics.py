"""Evaluation metrics for embeddings: Recall@K, MAP@R, R-precision, NMI, accuracy.

Every embedding is a query against all the others, ranked by (distance, index) as in
pytorch-metric-learning's AccuracyCalculator. Inputs: tensors (searched on their device) or
numpy arrays.
"""
from __future__ import annotations

import numbers
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ..bank.centroids import as_tensor, kmeans
from ..bank.search import iter_knn
from ..bank.search.knn import check_finite, check_search_backend
from ..validation import require_int, require_labelled, require_positive_int

__all__ = ["evaluate", "recall_at_k", "map_at_r", "nmi", "accuracy", "KMEANS_BACKENDS"]

KMEANS_BACKENDS = ("sklearn", "torch")
# Default CPU search budget of an evaluation (larger than a refresh's: it runs alone).
_EVAL_CPU_TILE_BYTES = 1 << 30


def _embeddings_and_labels(emb, labels) -> Tuple[Tensor, Tensor]:
    emb = as_tensor("emb", emb)
    labels = as_tensor("labels", labels)
    require_labelled("emb", emb, "labels", labels)
    if emb.shape[0] < 2:
        raise ValueError(f"emb needs at least 2 rows (each query is searched against the "
                         f"others), got {emb.shape[0]}")
    check_finite("emb", emb)  # named as passed (the search would say "queries")
    return emb, labels.to(emb.device).long()


def _ks_list(ks) -> list:
    try:
        return list(ks)
    except TypeError:
        raise TypeError(f"ks must be an iterable of ints, e.g. (1, 2, 4, 8), got {ks!r}") from None


def evaluate(emb, labels, ks: Iterable[int] = (1, 2, 4, 8), map_at_r: bool = True,
             search_backend: str = "auto", *, tile_bytes: Optional[int] = None,
             progress: bool = False) -> Dict[str, float]:
    """Recall@K for every K in ``ks`` and MAP@R / R-precision, from one exact search.

    Args:
        emb: (N, D) float embeddings (tensor or numpy array), N >= 2.
        labels: (N,) integer labels.
        ks: the K values of Recall@K, each in 1..N-1 (may be empty when ``map_at_r``).
        map_at_r: also compute MAP@R and R-precision (needs a class with two members).
        search_backend: "auto" (= "torch"), "torch" or "faiss" (see :func:`nnkloss.knn`).
        tile_bytes: the search's working-memory budget (default: 1 GiB on the CPU,
            :func:`nnkloss.knn`'s on CUDA).
        progress: a tqdm bar over the query rows.

    Returns:
        ``{"recall@K": .. for K in ks, "map@r": .., "r_precision": ..}`` (floats in [0, 1]).

    For a query with R other items of its class: Recall@K is 1 if a same-class item is among
    its K nearest (a query alone in its class: a miss), mean over all queries; MAP@R (Musgrave
    et al., 2020) the sum over its R nearest of the precisions at the ranks holding a
    same-class item, divided by R; R-precision the share of same-class items among its R
    nearest; both means over the queries with R >= 1. Memory: ``tile_bytes`` plus O(N).
    """
    emb, labels = _embeddings_and_labels(emb, labels)
    check_search_backend(search_backend)
    n = emb.shape[0]
    ks = _ks_list(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n - 1:
            raise ValueError(f"every value of ks must be an int in 1..{n - 1} (N - 1), got {k!r}")
    ks = [int(k) for k in ks]
    if not ks and not map_at_r:
        raise ValueError("nothing to evaluate: ks is empty and map_at_r is False")
    dev = emb.device
    _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    r = counts[inverse] - 1  # other items of each query's class
    classes = inverse.to(torch.int16 if counts.numel() <= 2**15 else torch.int32)
    counted = r > 0
    if map_at_r and not bool(counted.any()):
        raise ValueError("no class has two or more members: MAP@R is undefined")
    kmax = max(ks + ([int(r.max())] if map_at_r else []))
    if tile_bytes is None and dev.type == "cpu":
        tile_bytes = _EVAL_CPU_TILE_BYTES

    first_hit = torch.empty(n, dtype=torch.long, device=dev)  # rank of the first same-class
    ap = torch.zeros(n, dtype=torch.float64, device=dev)
    r_prec = torch.zeros(n, dtype=torch.float64, device=dev)
    ranks = torch.arange(1, kmax + 1, device=dev)
    ranks_f64 = ranks.to(torch.float64)
    from tqdm.auto import tqdm
    with tqdm(total=n, desc="evaluate", unit="query", leave=False, disable=not progress) as bar:
        for q0, _, idx in iter_knn(emb, emb, kmax, search_backend, exclude_self=True,
                                   tile_bytes=tile_bytes):
            rows = slice(q0, q0 + idx.shape[0])
            same = torch.take(classes, idx) == classes[rows, None]
            first_hit[rows] = torch.where(same.any(dim=1), same.to(torch.uint8).argmax(dim=1), kmax)
            if map_at_r:
                rr = r[rows]
                # AccuracyCalculator's MAP@R and R-precision, bit for bit.
                relevant = ranks[None, :] <= rr[:, None]
                correct = same & relevant
                cumulative = torch.cumsum(correct, dim=1, dtype=torch.int32)
                precision = (cumulative * correct).to(torch.float64).div_(ranks_f64)
                ap[rows] = torch.sum(precision, dim=1) / rr
                r_prec[rows] = torch.sum(correct, dim=1).type(torch.float64) / rr
            bar.update(idx.shape[0])
    out = {f"recall@{k}": float((first_hit < k).type(torch.float64).mean()) for k in ks}
    if map_at_r:
        out["map@r"] = float(torch.mean(ap[counted]))
        out["r_precision"] = float(torch.mean(r_prec[counted]))
    return out


def recall_at_k(emb, labels, ks: Iterable[int] = (1, 2, 4, 8),
                search_backend: str = "auto", **options) -> Dict[int, float]:
    """Recall@K as in :func:`evaluate` (same arguments), as {K: recall} in the order of ``ks``."""
    ks = _ks_list(ks)
    if not ks:
        raise ValueError("ks is empty")
    res = evaluate(emb, labels, ks, map_at_r=False, search_backend=search_backend, **options)
    return {int(k): res[f"recall@{int(k)}"] for k in ks}


def map_at_r(emb, labels, search_backend: str = "auto", **options) -> float:
    """MAP@R as defined in :func:`evaluate`; ValueError when no class has two members."""
    return evaluate(emb, labels, (), map_at_r=True, search_backend=search_backend,
                    **options)["map@r"]


def nmi(emb, labels, seed: int = 0, n_init: int = 10, kmeans_backend: str = "sklearn") -> float:
    """Normalised mutual information (arithmetic mean) between the labels and the lowest-inertia
    clustering of ``n_init`` k-means runs (one cluster per label, seeds from ``seed``);
    ``kmeans_backend``: "sklearn" or "torch" (:func:`nnkloss.bank.centroids.kmeans`)."""
    from sklearn.metrics import normalized_mutual_info_score

    emb, labels = _embeddings_and_labels(emb, labels)
    n_init = require_positive_int("n_init", n_init)
    if kmeans_backend not in KMEANS_BACKENDS:
        raise ValueError(f"kmeans_backend must be one of {KMEANS_BACKENDS}, got {kmeans_backend!r}")
    n_classes = int(torch.unique(labels).numel())
    if kmeans_backend == "sklearn":
        from sklearn.cluster import KMeans

        x = emb.to("cpu", torch.float64 if emb.dtype == torch.float64 else torch.float32)
        clusters = KMeans(n_clusters=n_classes, n_init=n_init, random_state=seed).fit_predict(
            x.numpy())
    else:
        x = emb.float()
        runs = (kmeans(x, n_classes, seed=seed + i) for i in range(n_init))
        _, assign = min(runs, key=lambda run: float((x - run[0][run[1]]).pow(2).sum()))
        clusters = assign.cpu().numpy()
    return float(normalized_mutual_info_score(labels.cpu().numpy(), clusters,
                                              average_method="arithmetic"))


def accuracy(pred, labels) -> float:
    """Share of positions where ``pred`` equals ``labels`` (both (B,) integer, tensor or numpy)."""
    pred = as_tensor("pred", pred)
    labels = as_tensor("labels", labels)
    require_int("pred", pred, 1)
    require_int("labels", labels, 1)
    if pred.shape != labels.shape:
        raise ValueError(f"pred has shape {tuple(pred.shape)} but labels has {tuple(labels.shape)}")
    if pred.numel() == 0:
        raise ValueError("pred is empty: accuracy is undefined")
    return float((pred.to(labels.device).long() == labels.long()).double().mean())
