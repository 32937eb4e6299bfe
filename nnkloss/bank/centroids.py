"""Centroid banks: class means (NCM) and k-means centroids per class (NCMC, Mensink et al.
2013). With such a bank, Eq. 3 with ``K`` = all centres and sigma = 1 is the NCM / NCMC
posterior, so the loss and the classifier run on it unchanged."""
from __future__ import annotations

import math
import numbers
from typing import Tuple

import numpy as np
import torch
from torch import Tensor

from ..validation import all_finite, require_float, require_labelled, require_positive_int
from .search import knn

__all__ = ["kmeans", "class_centroids", "as_tensor"]

_BANK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def as_tensor(name: str, x) -> Tensor:
    """A detached tensor from a tensor or a numpy array, TypeError naming ``name`` otherwise."""
    if isinstance(x, np.ndarray):
        # from_numpy refuses non-native byte orders and warns on read-only arrays.
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


def _sq_dist_to(x: Tensor, c: Tensor) -> Tensor:
    """(N,) squared distances of the rows of ``x`` to ``c`` (exactly 0 for duplicates)."""
    d = x - c
    return (d * d).sum(1)


def _require_seed(seed) -> None:
    """ValueError naming ``seed`` unless it is an int torch's generator takes."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
            or not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an int in [-2**63, 2**63), got {seed!r}")


def kmeans(x: Tensor, n_clusters: int, iters: int = 50, seed: int = 0, tol: float = 1e-7,
           search_backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Lloyd's k-means with greedy k-means++ seeding (as scikit-learn seeds it).

    ``x``: (N, D) float (math in fp32, fp64 for fp64); ``n_clusters``: at most the distinct
    rows; ``tol``: stop below this relative inertia decrease; ``search_backend``: of the
    assignment. Returns centroids (n_clusters, D) and the assignment (N,) int64.
    """
    require_float("x", x, 2)
    _require_seed(seed)
    return _kmeans(x, n_clusters, iters, seed, tol, search_backend, "x")


def _kmeans(x: Tensor, n_clusters: int, iters: int, seed: int, tol: float, search_backend: str,
            name: str) -> Tuple[Tensor, Tensor]:
    """:func:`kmeans`, its errors naming the points ``name``."""
    n_clusters = require_positive_int("n_clusters", n_clusters)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative int, got {iters!r}")
    n = x.shape[0]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(cdt)
    if not all_finite(x):
        raise ValueError(f"{name} contains NaN or inf")
    n_distinct = torch.unique(x, dim=0).shape[0] if n else 0
    if n_clusters > n_distinct:
        raise ValueError(f"n_clusters={n_clusters} but {name} has only {n_distinct} distinct "
                         "rows")
    if x.numel() and not bool(torch.isfinite(4 * (x * x).sum(1).amax())):  # squared distances
        raise ValueError(f"{name} holds rows too large to square in {x.dtype} (largest "
                         f"|value| {float(x.abs().max()):.3g}): k-means compares squared "
                         f"distances; scale them down")
    gen = torch.Generator().manual_seed(int(seed))

    # Greedy k-means++: of a few D^2-sampled candidates keep the one lowering the potential most.
    n_local = 2 + int(math.log(n_clusters))
    first = int(torch.randint(n, (1,), generator=gen))
    cents = [x[first]]
    closest = _sq_dist_to(x, x[first])
    for _ in range(1, n_clusters):
        p = closest.double().cpu()
        if not bool(p.sum() > 0):
            raise ValueError(f"{name} has {n_distinct} distinct rows, but their differences "
                             f"underflow to 0 when squared in {cdt}: scale them up")
        cand = torch.multinomial(p / p.sum(), n_local, replacement=True, generator=gen)
        trials = [torch.minimum(closest, _sq_dist_to(x, x[i])) for i in cand.tolist()]
        pots = [float(d.sum()) for d in trials]
        best = pots.index(min(pots))  # the first of equal potentials
        cents.append(x[int(cand[best])])
        closest = trials[best]
    cents = torch.stack(cents)

    prev = float("inf")
    for _ in range(iters):
        d, a = knn(x, cents, 1, search_backend=search_backend)
        assign = a[:, 0]
        inertia = float(d.sum())
        sums = torch.zeros_like(cents).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=n_clusters)
        empty = counts == 0
        if empty.any():
            # Re-seed empty clusters at the points farthest from their centroids.
            far = torch.argsort(d[:, 0], descending=True)[: int(empty.sum())]
            sums[empty] = x[far]
            counts = counts.masked_fill(empty, 1)
        cents = sums / counts[:, None].to(cdt)
        if prev - inertia <= tol * max(prev, 1e-30) and not empty.any():
            break
        prev = inertia
    _, a = knn(x, cents, 1, search_backend=search_backend)
    return cents, a[:, 0]


def class_centroids(emb, labels, per_class: int = 1, seed: int = 0, iters: int = 50,
                    search_backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Centres for an NCM / NCMC bank, from ``emb`` (N, D) float and ``labels`` (N,) int >= 0
    (tensors or numpy arrays): the class means (fp64 sums) for ``per_class`` 1, else k-means
    in each class (at most one centroid per distinct row) seeded from ``(seed, label)``.
    Returns centres (M, D) in emb's dtype (fp32 for fp64) and centre_labels (M,) int64, by
    class."""
    emb = as_tensor("emb", emb)
    labels = as_tensor("labels", labels).to(emb.device)
    require_labelled("emb", emb, "labels", labels)
    if emb.shape[0] == 0:
        raise ValueError("emb is empty: no class to compute centroids for")
    per_class = require_positive_int("per_class", per_class)
    _require_seed(seed)
    if not all_finite(emb):
        raise ValueError("emb contains NaN or inf")
    labels = labels.long()
    if int(labels.min()) < 0:
        raise ValueError(f"labels must be >= 0, got {int(labels.min())}")
    out_dtype = emb.dtype if emb.dtype in _BANK_DTYPES else torch.float32
    classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)

    if per_class == 1:
        sums = torch.zeros(classes.shape[0], emb.shape[1], dtype=torch.float64, device=emb.device)
        sums.index_add_(0, inverse, emb.double())
        means = sums / counts[:, None].double()
        return _finite_centres(means.to(out_dtype), emb), classes

    order = torch.argsort(inverse, stable=True)  # rows grouped by class, one sort for all
    cdt = torch.float64 if emb.dtype == torch.float64 else torch.float32
    centres, centre_labels = [], []
    for ci, rows in enumerate(order.split(counts.tolist())):
        pts = emb[rows].to(cdt)
        distinct = torch.unique(pts, dim=0)
        if distinct.shape[0] <= per_class:
            cents = distinct
        else:
            # The class's seed: 64 bits of a SeedSequence over (seed, label).
            words = np.random.SeedSequence([int(seed) & (2 ** 64 - 1), int(classes[ci])])
            lo, hi = words.generate_state(2, np.uint32).tolist()
            cents, _ = _kmeans(pts, per_class, iters, lo | (hi << 32), 1e-7, search_backend,
                               f"emb (the rows of class {int(classes[ci])})")
        centres.append(cents)
        centre_labels.append(classes[ci].expand(cents.shape[0]))
    return _finite_centres(torch.cat(centres).to(out_dtype), emb), torch.cat(centre_labels)


def _finite_centres(centres: Tensor, emb: Tensor) -> Tensor:
    """``centres``, or ValueError naming ``emb`` where the cast overflowed."""
    if not all_finite(centres):
        raise ValueError(f"emb holds {emb.dtype} values whose centres overflow {centres.dtype} "
                         f"(largest |value| {float(emb.abs().max()):.3g}): the centres of "
                         f"{emb.dtype} embeddings are {centres.dtype}; scale emb down")
    return centres
