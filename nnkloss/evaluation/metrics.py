"""Evaluation metrics for embeddings: Recall@K, MAP@R, R-precision, NMI, accuracy.

Retrieval metrics follow the standard protocol: every embedding is a query against all the
others, its own row excluded (by index: an exact duplicate of the query is a neighbour at
distance 0). :func:`evaluate` searches once, for the largest number of neighbours any metric
needs, and reduces each block of query rows as the search yields it, so memory stays bounded
by the search's tile budget plus O(N) per-query results, never N x N or N x K.
:func:`recall_at_k` and :func:`map_at_r` are :func:`evaluate` asked for one metric.

Neighbours are ranked by (distance, index), as faiss's flat index (and so pytorch-metric-
learning's AccuracyCalculator) ranks them; the values are those of AccuracyCalculator's
``precision_at_1``, ``mean_average_precision_at_r`` and ``r_precision`` whenever both compute
the same fp32 distances (always for ties of exactly representable distances; otherwise two
neighbours whose distances differ by a rounding error may be ranked differently), with one
difference of protocol: a query whose class has no other member counts as a miss in Recall@K
here, where AccuracyCalculator leaves it out of ``precision_at_1`` (40 points with one such
query: 0.125 here, 0.1282 there). Without such classes the recalls are equal.

Inputs may be torch tensors (any device; the search runs there) or numpy arrays (CPU).
"""
from __future__ import annotations

import numbers
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..bank.centroids import kmeans
from ..bank.search import iter_knn
from ..bank.search.validation import check_finite, check_search_backend
from ..validation import require_int, require_labelled, require_positive_int

__all__ = ["evaluate", "recall_at_k", "map_at_r", "nmi", "accuracy", "KMEANS_BACKENDS"]

KMEANS_BACKENDS = ("sklearn", "torch")
# Default search budget of an evaluation on the CPU: larger blocks than a refresh's search
# (evaluation runs alone, and fewer blocks mean fewer passes of small ops per query row).
_EVAL_CPU_TILE_BYTES = 1 << 30


def _as_tensor(name: str, x) -> Tensor:
    if isinstance(x, np.ndarray):
        # torch.from_numpy refuses a non-native byte order (a big-endian file's array) and
        # dtypes it has none of, with errors that name no argument, and warns on a read-only
        # array (np.load's memory map, np.frombuffer): those are converted or copied first.
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        if not x.flags.writeable:
            x = np.array(x)
        try:
            return torch.from_numpy(np.ascontiguousarray(x))
        except TypeError as exc:
            raise TypeError(f"{name} has a numpy dtype torch cannot hold ({x.dtype}): "
                            f"{exc}") from None
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
    check_finite("emb", emb)  # named as the caller passed it (the search would say "queries")
    return emb, labels.to(emb.device).long()


def _ks_list(ks) -> list:
    # ks=5 (for (5,)) would otherwise fail as "'int' object is not iterable", naming nothing
    try:
        return list(ks)
    except TypeError:
        raise TypeError(f"ks must be an iterable of ints, e.g. (1, 2, 4, 8), got {ks!r}") from None


def _check_ks(ks, n: int) -> list:
    ks = _ks_list(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n - 1:
            raise ValueError(f"every value of ks must be an int in 1..{n - 1} (N - 1), got {k!r}")
    return [int(k) for k in ks]


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
        tile_bytes: the search's working-memory budget per block (default: 1 GiB on the CPU,
            :func:`nnkloss.knn`'s default on CUDA). A budget that holds every row's selection
            state runs the symmetric search (half the GEMM) where K is at most 3 x (D + 2
            rounded up to 8): faster at 30,000 points (K 300, D 128), slower at 150,000
            (24.7 against 22.7 s, 4.4 GB peak; docs/PERFORMANCE.md).
        progress: show a progress bar over the query rows (tqdm).

    Returns:
        ``{"recall@K": .. for K in ks, "map@r": .., "r_precision": ..}`` (floats in [0, 1]).

    Definitions, for a query with R other items of its class:

    * Recall@K: 1 if a same-class item is among its K nearest, else 0; mean over all N queries
      (a query alone in its class counts as a miss).
    * MAP@R (Musgrave et al., "A Metric Learning Reality Check", 2020): over its R nearest,
      the sum of the precisions at the ranks holding a same-class item, divided by R;
      R-precision: the share of same-class items among its R nearest. Both are means over the
      queries with R >= 1 (the others have no defined value).

    One search for ``max(max(ks), largest R)`` neighbours feeds every metric. Memory: an fp32
    copy of the embeddings with up to 8 extra columns, the search's working set (at most
    ``tile_bytes``: on the CPU with the compiled selection one (2048, 4096) fp32 distance tile
    and (K + max(K, 64)) x 8 + K x 12 bytes per query row of it, or, where the selection state
    of all N rows fits the budget (N (cap x 8 + 16) bytes, cap = K + max(K, 64)) and K is at
    most 3 x (D + 2 rounded up to 8), the symmetric self-search, which computes each pair
    once; see
    :mod:`nnkloss.bank.search.torch_search`),
    per-block (rows, K) temporaries and O(N) results; never N x N. Measured at N = 150,000,
    D = 128, K = 1,499 on the 2-core AMD EPYC family 26 (at ``44bdeda``): 0.94 GB peak RSS,
    0.34 GB above the process before the call, 22.9 s (``benchmarks/bench_eval.py``,
    docs/PERFORMANCE.md, "Evaluation at scale"). On CUDA the search's budget is a quarter of
    the device's free memory, at most 4 GiB: the same call on an H200 (at ``654dba3``) took
    0.42 s and 3.5 GB of GPU memory (docs/PERFORMANCE.md, "The GPU figures").
    """
    emb, labels = _embeddings_and_labels(emb, labels)
    check_search_backend(search_backend)
    n = emb.shape[0]
    ks = _check_ks(ks, n)
    if not ks and not map_at_r:
        raise ValueError("nothing to evaluate: ks is empty and map_at_r is False")
    dev = emb.device
    _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    r = counts[inverse] - 1  # other items of each query's class
    # Each item's class as the smallest integer that holds it: the blocks' (rows, K) label
    # gathers then read a 300 KB table at N = 150,000 (int16) instead of 1.2 MB (int64).
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
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=n, desc="evaluate", unit="query", leave=False)
    try:
        for q0, _, idx in iter_knn(emb, emb, kmax, search_backend, exclude_self=True,
                                   tile_bytes=tile_bytes):
            rows = slice(q0, q0 + idx.shape[0])
            # torch.take: the gather of a flat table, 2.8x faster than classes[idx] on
            # (2048, 1499) blocks (the 2-core AMD EPYC family 26, 2026-11-27)
            same = torch.take(classes, idx) == classes[rows, None]
            hit = same.any(dim=1)
            first_hit[rows] = torch.where(hit, same.to(torch.uint8).argmax(dim=1), kmax)
            if map_at_r:
                rr = r[rows]
                # The values of AccuracyCalculator's mean_average_precision(at_r=True) and
                # r_precision, bit for bit, so that equal neighbours give bit-equal per-query
                # values: its precision (cumsum(correct) * correct / ranks in float64, the
                # counts exact in int32 as in its int64) and its sums over the same float64
                # rows (its precision * relevant IS precision: correct implies relevant).
                # Per block 1.2 ms of cumsum against 7.4 in int64, and no product pass.
                relevant = ranks[None, :] <= rr[:, None]
                correct = same & relevant
                cumulative = torch.cumsum(correct, dim=1, dtype=torch.int32)
                precision = (cumulative * correct).to(torch.float64).div_(ranks_f64)
                ap[rows] = torch.sum(precision, dim=1) / rr
                r_prec[rows] = torch.sum(correct, dim=1).type(torch.float64) / rr
            if bar is not None:
                bar.update(idx.shape[0])
    finally:
        if bar is not None:
            bar.close()
    out = {f"recall@{k}": float((first_hit < k).type(torch.float64).mean()) for k in ks}
    if map_at_r:
        out["map@r"] = float(torch.mean(ap[counted]))
        out["r_precision"] = float(torch.mean(r_prec[counted]))
    return out


def recall_at_k(emb, labels, ks: Iterable[int] = (1, 2, 4, 8),
                search_backend: str = "auto", **options) -> Dict[int, float]:
    """Recall@K: the share of queries with at least one same-class item among their K nearest.

    Args:
        emb: (N, D) float embeddings (tensor or numpy array), N >= 2.
        labels: (N,) integer labels.
        ks: the K values, each in 1..N-1.
        search_backend: "auto", "torch" or "faiss" (see :func:`nnkloss.knn`).
        options: ``tile_bytes``, ``progress`` as in :func:`evaluate`.

    Returns:
        {K: recall in [0, 1]} in the order of ``ks``. Queries whose class has no other member
        count as misses. One search (:func:`evaluate`); ask :func:`evaluate` for Recall@K and
        MAP@R together rather than calling this and :func:`map_at_r`.
    """
    ks = _ks_list(ks)
    if not ks:
        raise ValueError("ks is empty")
    res = evaluate(emb, labels, ks, map_at_r=False, search_backend=search_backend, **options)
    return {int(k): res[f"recall@{int(k)}"] for k in ks}


def map_at_r(emb, labels, search_backend: str = "auto", **options) -> float:
    """MAP@R (Musgrave et al., "A Metric Learning Reality Check", 2020), see :func:`evaluate`.

    For a query with R other same-class items, retrieve its R nearest neighbours (own row
    excluded) and average ``P(i)`` over ``i = 1..R``, where ``P(i)`` is the precision at rank i
    if the i-th neighbour is same-class and 0 otherwise. The result is the mean over queries
    with R >= 1. Raises ValueError when no class has two members.
    """
    return evaluate(emb, labels, (), map_at_r=True, search_backend=search_backend,
                    **options)["map@r"]


def nmi(emb, labels, seed: int = 0, n_init: int = 10, kmeans_backend: str = "sklearn") -> float:
    """Normalised mutual information between k-means clusters and the labels.

    k-means runs with as many clusters as there are distinct labels, ``n_init`` times from
    different seeds; the clustering with the lowest inertia is scored. NMI uses the arithmetic
    mean of the two entropies (scikit-learn's default normalisation).

    Args:
        emb: (N, D) float embeddings (tensor or numpy array).
        labels: (N,) integer labels.
        seed: k-means seed (deterministic for a given seed).
        n_init: k-means runs (>= 1; default 10: a single run varies by several NMI points
            from seed to seed).
        kmeans_backend: "sklearn" (``sklearn.cluster.KMeans``, CPU, the usual protocol) or
            "torch" (:func:`nnkloss.bank.centroids.kmeans`, on emb's device: faster for large
            N on a GPU).
    """
    from sklearn.metrics import normalized_mutual_info_score

    emb, labels = _embeddings_and_labels(emb, labels)
    n_init = require_positive_int("n_init", n_init)
    if kmeans_backend not in KMEANS_BACKENDS:
        raise ValueError(f"kmeans_backend must be one of {KMEANS_BACKENDS}, "
                         f"got {kmeans_backend!r}")
    n_classes = int(torch.unique(labels).numel())
    if kmeans_backend == "sklearn":
        from sklearn.cluster import KMeans

        x = emb.to("cpu", torch.float64 if emb.dtype == torch.float64 else torch.float32)
        clusters = KMeans(n_clusters=n_classes, n_init=n_init, random_state=seed).fit_predict(
            x.numpy())
    else:
        x = emb.float()
        best = None
        for i in range(n_init):
            cents, assign = kmeans(x, n_classes, seed=seed + i)
            inertia = float((x - cents[assign]).pow(2).sum())
            if best is None or inertia < best[0]:
                best = (inertia, assign)
        clusters = best[1].cpu().numpy()
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
