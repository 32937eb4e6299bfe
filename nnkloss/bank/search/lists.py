"""Neighbour lists of a set of centres: the k nearest other centres of each, and optionally a
guaranteed same-label entry (``ensure_positive``)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ...validation import plain_eager, require_labelled
from .exclusion import drop_self
from .knn import knn, resolve_search_backend

__all__ = ["NeighbourLists", "neighbour_lists", "patch_positives", "has_same_label",
           "synchronize"]


@dataclass
class NeighbourLists:
    """What :func:`neighbour_lists` builds; the first two fields are :func:`~.knn.knn`'s
    (N, k) results, own row excluded (-1 / inf: padding, approximate search only).

    has_positive: (N,) bool, the list holds a centre of the row's own label.
    num_patched: rows whose last entry became their nearest same-label centre.
    seconds: wall time of the search (CUDA synchronised); search_backend: the search that ran.
    """
    distances: Tensor
    neighbours: Tensor
    has_positive: Tensor
    num_patched: int
    seconds: float
    search_backend: str


def has_same_label(neighbours: Tensor, centre_labels: Tensor) -> Tensor:
    """(N,) bool: row i's list ``neighbours[i]`` (-1 = padding) holds a row of label
    ``centre_labels[i]`` (the compiled CPU pass where it serves)."""
    if plain_eager(neighbours, centre_labels):
        from ... import cpu
        out = cpu.has_same_label(neighbours, centre_labels)
        if out is not None:
            return out
    nb_labels = centre_labels[neighbours.clamp_min(0)]
    return ((nb_labels == centre_labels.unsqueeze(1)) & (neighbours >= 0)).any(dim=1)


def search_name(search_backend: str, knn_options: dict) -> str:
    """The search that runs: "torch", "faiss", "faiss-ivf" or "faiss-hnsw"."""
    approximate = knn_options.get("approximate")
    return f"faiss-{approximate}" if approximate else resolve_search_backend(search_backend)


def synchronize(device: torch.device) -> None:
    # The calling thread's stream only: a background refresh must not wait for training.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def patch_positives(centres: Tensor, labels: Tensor, rows_offset: int, dist_: Tensor,
                    ids: Tensor, has_pos: Tensor, search_backend: str, knn_options: dict) -> int:
    """``ensure_positive`` in place on the lists ``(dist_, ids)`` and flags ``has_pos`` of rows
    from ``rows_offset``; returns the number patched."""
    approximate = knn_options.get("approximate")
    exact = {key: v for key, v in knn_options.items() if key == "tile_bytes"}
    missing = (~has_pos).nonzero().flatten()
    patched = 0
    for cls in labels[missing + rows_offset].unique().tolist():
        local = missing[labels[missing + rows_offset] == cls]
        rows = local + rows_offset
        members = (labels == cls).nonzero().flatten()  # ascending
        if members.numel() < 2:  # the only centre of its class: nothing to add
            continue
        m_d, m_i = knn(centres[rows], centres[members], 2,
                       search_backend if approximate is None else "auto", **exact)
        own = torch.searchsorted(members, rows)
        m_d, m_i = drop_self(m_d, m_i, own, 1)
        ids[local, -1] = members[m_i[:, 0]]
        dist_[local, -1] = m_d[:, 0]
        has_pos[local] = True
        patched += int(local.numel())
    if patched and approximate is not None:  # padding may precede the patched last slot
        sorted_d, order = dist_.sort(dim=1, stable=True)
        dist_.copy_(sorted_d)
        ids.copy_(ids.gather(1, order))
    return patched


def neighbour_lists(centres: Tensor, centre_labels: Tensor, k: int, search_backend: str = "auto",
                    ensure_positive: bool = False, **knn_options) -> NeighbourLists:
    """The k nearest other centres of every centre (self excluded), optionally with a positive.

    ``centres`` (N, D) float, ``centre_labels`` (N,) int; ``k``: 1 <= k <= N - 1;
    ``search_backend``, ``knn_options``: as in :func:`knn`. ``ensure_positive``: a row without
    a same-label entry gets its nearest same-label centre, where one exists, in its last slot.
    """
    require_labelled("centres", centres, "centre_labels", centre_labels)
    labels = centre_labels.to(centres.device).long()
    used = search_name(search_backend, knn_options)
    synchronize(centres.device)
    t0 = time.perf_counter()
    dist, idx = knn(centres, centres, k, search_backend, exclude_self=True, **knn_options)
    has_pos = has_same_label(idx, labels)
    num_patched = (patch_positives(centres, labels, 0, dist, idx, has_pos, search_backend,
                                   knn_options) if ensure_positive else 0)
    synchronize(centres.device)
    return NeighbourLists(dist, idx, has_pos, num_patched, time.perf_counter() - t0, used)
