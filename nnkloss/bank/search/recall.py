"""How much an approximate index loses: its recall against exact search on sampled queries."""
from __future__ import annotations

import torch
from torch import Tensor

from ...validation import require_positive_int
from .exclusion import drop_self
from .faiss_search import (build_approximate, check_index_options, require_faiss,
                           search_index)
from .knn import knn
from .validation import validate

__all__ = ["recall_against_exact"]

_RECALL_PARAMS = {"nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "train_size",
                  "tile_bytes"}


def recall_against_exact(queries: Tensor, base: Tensor, k: int, approximate: str = "ivf",
                         sample: int = 1000, exclude_self: bool = False, seed: int = 0,
                         exact_search_backend: str = "auto", **params) -> float:
    """Recall@k of an approximate index against exact search, on a random sample of queries.

    The mean over ``min(sample, Q)`` random queries of the share of the k found that are as
    close as the exact k-th neighbour (ties not penalised). ``params``: :func:`knn`'s index
    options and ``tile_bytes``; ``seed`` picks the sample and seeds IVF's training.
    """
    if approximate not in ("ivf", "hnsw"):
        raise ValueError(f"approximate must be 'ivf' or 'hnsw', got {approximate!r}")
    sample = require_positive_int("sample", sample)
    unknown = set(params) - _RECALL_PARAMS
    if unknown:
        raise TypeError(f"recall_against_exact got unknown parameters {sorted(unknown)}; "
                        f"accepted: {sorted(_RECALL_PARAMS)}")
    check_index_options(approximate, params)
    require_faiss(f"approximate={approximate!r}")
    k = validate(queries, base, k, exclude_self)
    q = queries.shape[0]
    if q == 0:
        raise ValueError("queries is empty: there is nothing to measure recall on")
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(q, generator=g)[:min(int(sample), q)].sort().values.to(queries.device)
    sub = queries[rows]
    kk = k + int(exclude_self)
    index = build_approximate(base, approximate, params.get("nlist"), params.get("nprobe"),
                              params.get("hnsw_m"), params.get("ef_construction"),
                              params.get("ef_search"), k, params.get("train_size"),
                              seed if approximate == "ivf" else None)
    a_d, a_i = search_index(index, sub, min(kk, base.shape[0]))
    e_d, e_i = knn(sub, base, kk, exact_search_backend, tile_bytes=params.get("tile_bytes"))
    if exclude_self:
        a_d, a_i = drop_self(a_d, a_i, rows, k)
        e_d, e_i = drop_self(e_d, e_i, rows, k)
    kth = e_d[:, -1:].float()
    # Same fp32 expansion on both sides; a small relative slack absorbs rounding differences.
    hit = (a_i >= 0) & (a_d <= kth * (1 + 1e-5) + 1e-6)
    return float(hit.sum(1).clamp_max(k).float().mean() / k)
