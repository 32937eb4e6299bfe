"""Evaluation metrics for embeddings: Recall@K, NMI, MAP@R, accuracy.

Retrieval metrics follow the standard protocol: every embedding is a query against all the
others (its own row excluded). Neighbours come from :func:`nnkloss.knn` in chunks of query rows,
so memory grows with N x (neighbours needed), never N x N. Inputs may be torch tensors (any
device; the search runs there) or numpy arrays (searched on the CPU).
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, Tuple

import numpy as np
import torch
from torch import Tensor

from ..validation import require_int, require_labelled
from ..bank.search import KNN_BACKENDS, knn

__all__ = ["recall_at_k", "nmi", "accuracy", "map_at_r"]

# Result entries (query rows x neighbours) per search call: 2**22 (32 MiB of int64 indices).
_RESULT_ELEMS = 1 << 22


def _as_tensor(name: str, x) -> Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, Tensor):
        return x.detach()
    raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _embeddings_and_labels(emb, labels) -> Tuple[Tensor, Tensor]:
    emb = _as_tensor("emb", emb)
    labels = _as_tensor("labels", labels)
    require_labelled("emb", emb, "labels", labels)
    if emb.shape[0] < 2:
        raise ValueError(f"emb needs at least 2 rows (each query is searched against the "
                         f"others), got {emb.shape[0]}")
    return emb, labels.to(emb.device).long()


def _check_backend(backend: str) -> None:
    if backend not in KNN_BACKENDS:
        raise ValueError(f"backend must be one of {KNN_BACKENDS}, got {backend!r}")


def _neighbours_excluding_self(emb: Tensor, rows: Tensor, k: int, backend: str) -> Tensor:
    """(len(rows), k) int64 indices of the k nearest rows of ``emb`` to ``emb[rows]``, each
    query's own row excluded (by index: exact duplicates of it still count as neighbours)."""
    n = emb.shape[0]
    kk = min(k + 1, n)
    dist, idx = knn(emb[rows], emb, kk, backend=backend)
    is_self = idx == rows[:, None]
    # Own row to the end; if it was not among the k+1 (a tie of duplicates at distance 0),
    # the last one goes, so k neighbours other than the query remain either way.
    dist = dist.masked_fill(is_self, math.inf)
    order = torch.sort(dist, dim=1, stable=True).indices
    return idx.gather(1, order)[:, :k]


def recall_at_k(emb, labels, ks: Iterable[int] = (1, 2, 4, 8),
                backend: str = "auto") -> Dict[int, float]:
    """Recall@K: the share of queries with at least one same-class item among their K nearest.

    Args:
        emb: (N, D) float embeddings (tensor or numpy array), N >= 2.
        labels: (N,) integer labels.
        ks: the K values, each in 1..N-1.
        backend: search backend ("auto", "torch", "faiss"; see :func:`nnkloss.knn`).

    Returns:
        {K: recall in [0, 1]} in the order of ``ks``. Queries whose class has no other member
        count as misses.
    """
    emb, labels = _embeddings_and_labels(emb, labels)
    _check_backend(backend)
    ks = list(ks)
    n = emb.shape[0]
    if not ks:
        raise ValueError("ks is empty")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n - 1:
            raise ValueError(f"every value of ks must be an int in 1..{n - 1} (N - 1), got {k!r}")
    kmax = max(ks)
    # Rank of each query's first same-class neighbour (kmax when none within kmax).
    first_hit = torch.empty(n, dtype=torch.long, device=emb.device)
    step = max(1, _RESULT_ELEMS // (kmax + 1))
    for lo in range(0, n, step):
        rows = torch.arange(lo, min(n, lo + step), device=emb.device)
        nb = _neighbours_excluding_self(emb, rows, kmax, backend)
        hit = labels[nb] == labels[rows, None]
        rank = torch.where(hit, torch.arange(kmax, device=emb.device), kmax)
        first_hit[lo:lo + rows.shape[0]] = rank.min(dim=1).values
    return {int(k): float((first_hit < k).double().mean()) for k in ks}


def map_at_r(emb, labels, backend: str = "auto") -> float:
    """MAP@R (Musgrave et al., "A Metric Learning Reality Check", 2020).

    For a query with R other same-class items, retrieve its R nearest neighbours (own row
    excluded) and average ``P(i)`` over ``i = 1..R``, where ``P(i)`` is the precision at rank i
    if the i-th neighbour is same-class and 0 otherwise (i.e. the sum of precisions at the
    correct ranks, divided by R). The result is the mean over queries. Queries alone in their
    class (R = 0) have no defined MAP@R and are left out.

    Args:
        emb: (N, D) float embeddings (tensor or numpy array).
        labels: (N,) integer labels.
        backend: search backend.

    Queries are processed in order of R so that each search asks for about as many
    neighbours as its rows need; memory is bounded by ~2**22 result entries per call (or R_max
    for one query, if larger). Raises ValueError when no class has two members.
    """
    emb, labels = _embeddings_and_labels(emb, labels)
    _check_backend(backend)
    n = emb.shape[0]
    _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    r = counts[inverse] - 1  # other items of each query's class
    queries = torch.nonzero(r > 0).flatten()
    if queries.numel() == 0:
        raise ValueError("no class has two or more members: MAP@R is undefined")
    queries = queries[torch.argsort(r[queries], stable=True)]
    r_sorted = r[queries].cpu().numpy()
    total = torch.zeros((), dtype=torch.float64, device=emb.device)
    lo, m = 0, queries.shape[0]
    while lo < m:
        # Largest chunk whose (rows x its own max R) fits the budget; R grows along the order.
        width = max(1, min(m - lo, _RESULT_ELEMS // int(r_sorted[lo] + 1)))
        while width > 1 and width * int(r_sorted[lo + width - 1] + 1) > _RESULT_ELEMS:
            width //= 2
        rows = queries[lo:lo + width]
        rr = r[rows]
        kmax = min(int(r_sorted[lo + width - 1]), n - 1)
        nb = _neighbours_excluding_self(emb, rows, kmax, backend)
        ranks = torch.arange(1, kmax + 1, device=emb.device)
        correct = (labels[nb] == labels[rows, None]) & (ranks[None, :] <= rr[:, None])
        precision = correct.double().cumsum(dim=1) / ranks.double()
        total += ((precision * correct).sum(dim=1) / rr.double()).sum()
        lo += width
    return float(total / m)


def nmi(emb, labels, seed: int = 0, kmeans: str = "sklearn") -> float:
    """Normalised mutual information between k-means clusters and the labels.

    k-means runs with as many clusters as there are distinct labels; NMI uses the arithmetic
    mean of the two entropies (scikit-learn's default normalisation).

    Args:
        emb: (N, D) float embeddings (tensor or numpy array).
        labels: (N,) integer labels.
        seed: k-means seed (deterministic for a given seed).
        kmeans: "sklearn" (``sklearn.cluster.KMeans``, CPU, the usual protocol) or "torch"
            (:func:`nnkloss.bank.centroids.kmeans`, on emb's device: faster for large N on a GPU).
    """
    from sklearn.metrics import normalized_mutual_info_score

    emb, labels = _embeddings_and_labels(emb, labels)
    if kmeans not in ("sklearn", "torch"):
        raise ValueError(f"kmeans must be 'sklearn' or 'torch', got {kmeans!r}")
    if not bool(torch.isfinite(emb).all()):
        raise ValueError("emb contains NaN or inf")
    n_classes = int(torch.unique(labels).numel())
    if kmeans == "sklearn":
        from sklearn.cluster import KMeans

        x = emb.to("cpu", torch.float64 if emb.dtype == torch.float64 else torch.float32)
        clusters = KMeans(n_clusters=n_classes, n_init=1, random_state=seed).fit_predict(
            x.numpy())
    else:
        from ..bank.centroids import kmeans as torch_kmeans

        _, assign = torch_kmeans(emb, n_classes, seed=seed)
        clusters = assign.cpu().numpy()
    return float(normalized_mutual_info_score(labels.cpu().numpy(), clusters,
                                              average_method="arithmetic"))


def accuracy(pred, labels) -> float:
    """Share of positions where ``pred`` equals ``labels`` (both (B,) integer, tensor or numpy)."""
    pred = _as_tensor("pred", pred)
    labels = _as_tensor("labels", labels)
    require_int("pred", pred, 1)
    require_int("labels", labels, 1)
    if pred.shape != labels.shape:
        raise ValueError(f"pred has shape {tuple(pred.shape)} but labels has "
                         f"{tuple(labels.shape)}")
    if pred.numel() == 0:
        raise ValueError("pred is empty: accuracy is undefined")
    return float((pred.to(labels.device).long() == labels.long()).double().mean())
