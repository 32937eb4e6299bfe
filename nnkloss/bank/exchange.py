"""The bank under ``torch.distributed``: the row exchange and the sharded neighbour-list search.
Every rank ends with the same bank, byte for byte; errors found during a collective are raised
on every rank (one rank raising alone would leave the others waiting)."""
from __future__ import annotations

import itertools
import math
import numbers
import time
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import comm_device, is_distributed, rank, world_size
from ..validation import FLOAT_DTYPES, require_float, require_int, require_labelled
from .search import (NeighbourLists, drop_self, knn, neighbour_lists as single_process_lists,
                     patch_positives, synchronize)
from .search.lists import search_name

__all__ = ["gather_bank_rows", "gather_batch_rows", "neighbour_lists", "check_async_refresh",
           "GATHER_CHUNK_BYTES"]

# Per-rank send buffer of one all_gather round: no second (N, D) buffer is ever needed.
GATHER_CHUNK_BYTES = 64 * 2**20


def _all_gather_same(t: Tensor, group) -> List[Tensor]:
    """all_gather of a tensor that has the same shape on every rank."""
    out = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _all_gather_rows(local: Tensor, counts: Sequence[int],
                     place: Callable[[int, int, Tensor], None], group, comm: torch.device,
                     chunk_bytes: int = GATHER_CHUNK_BYTES) -> None:
    """Gather ``counts[r]`` rows of ``local`` from every rank r in padded rounds of bounded
    size, calling ``place(r, first, rows)`` with each rank's valid rows (on ``comm``)."""
    most = max(counts) if counts else 0
    if most == 0:
        return
    row_shape = tuple(local.shape[1:])
    row_bytes = max(1, math.prod(row_shape) * local.element_size())
    chunk = max(1, min(most, chunk_bytes // row_bytes))
    for c0 in range(0, most, chunk):
        m = min(chunk, most - c0)
        send = torch.zeros((m,) + row_shape, dtype=local.dtype, device=comm)
        mine = local[c0:c0 + m]
        send[:mine.shape[0]] = mine.to(comm)
        for r, buf in enumerate(_all_gather_same(send, group)):
            got = min(m, max(0, counts[r] - c0))
            if got:
                place(r, c0, buf[:got])


def _placer(out: Tensor, starts: Sequence[int]) -> Callable[[int, int, Tensor], None]:
    """A ``place`` that writes rank r's rows into ``out`` from row ``starts[r]`` on."""
    def place(r: int, first: int, rows: Tensor) -> None:
        a = starts[r] + first
        out[a:a + rows.shape[0]] = rows.to(out.device, out.dtype)
    return place


def gather_batch_rows(idx: Tensor, emb: Tensor, group=None) -> Tuple[Tensor, Tensor]:
    """Every rank's ``(idx (B_r,), emb (B_r, D))`` concatenated in rank order, on every rank.
    Arguments are checked before any collective; ranks differing in D or dtype raise."""
    require_int("idx", idx, 1)
    require_float("emb", emb, 2)
    if emb.shape[0] != idx.shape[0]:
        raise ValueError(f"emb has {emb.shape[0]} rows but idx has {idx.shape[0]}: one "
                         "embedding per bank row")
    comm = comm_device(group, emb.device)
    # Each rank's rows, embedding size and dtype in one all_gather.
    head = torch.tensor([idx.shape[0], emb.shape[1], FLOAT_DTYPES.index(emb.dtype)],
                        dtype=torch.int64, device=comm)
    heads = torch.stack(_all_gather_same(head, group)).tolist()  # NCCL: one host sync
    if len({(d, t) for _, d, t in heads}) > 1:
        raise ValueError("emb differs across ranks: (rows, D, dtype) per rank "
                         + ", ".join(f"{r}: ({b}, {d}, {FLOAT_DTYPES[t]})"
                                     for r, (b, d, t) in enumerate(heads))
                         + "; every rank must send embeddings of one size and dtype")
    counts = [b for b, _, _ in heads]
    offsets = [0, *itertools.accumulate(counts)]
    all_idx = torch.empty(offsets[-1], dtype=torch.int64, device=emb.device)
    all_emb = torch.empty(offsets[-1], emb.shape[1], dtype=emb.dtype, device=emb.device)
    _all_gather_rows(idx.long(), counts, _placer(all_idx, offsets), group, comm)
    _all_gather_rows(emb.contiguous(), counts, _placer(all_emb, offsets), group, comm)
    return all_idx, all_emb


def check_async_refresh() -> None:
    """Refuse a background refresh under torch.distributed."""
    if is_distributed():
        raise RuntimeError("asynchronous refresh is not supported under torch.distributed "
                           "(ranks would swap banks at different steps, and its collectives "
                           "would race DDP's); use Refresher(..., async_mode=False)")


@torch.no_grad()
def gather_bank_rows(centres: Tensor, centre_labels: Tensor, written: Tensor, group=None,
                     chunk_bytes: int = GATHER_CHUNK_BYTES) -> Tuple[Tensor, Tensor]:
    """Complete a bank from every rank's share, in place; all ranks end identical.

    ``centres`` (N, D) and ``centre_labels`` (N,) hold this rank's rows where ``written``
    (N,) bool is set; a row written by several ranks is taken from the lowest. ValueError on
    every rank for unwritten rows, NaN/inf embeddings, conflicting labels or banks of
    different N, D or dtype.
    """
    require_float("centres", centres, 2, FLOAT_DTYPES)
    require_int("centre_labels", centre_labels, 1)
    n, d = centres.shape
    if centre_labels.shape[0] != n:
        raise ValueError(f"centre_labels has length {centre_labels.shape[0]} but centres has "
                         f"{n} rows")
    if not isinstance(written, Tensor) or written.dtype != torch.bool:
        got = written.dtype if isinstance(written, Tensor) else type(written).__name__
        raise TypeError(f"written must be a bool tensor (the mask of the rows this rank "
                        f"wrote), got {got}")
    if written.shape != (n,):
        raise ValueError(f"written must have shape ({n},) (one flag per bank row), got "
                         f"{tuple(written.shape)}")
    dev = centres.device
    w, me = world_size(group), rank(group)
    comm = comm_device(group, dev)
    local_idx = written.to(dev).nonzero().flatten()  # ascending: a deterministic order
    local_rows = centres[local_idx]
    bad_rows = int((~torch.isfinite(local_rows)).any(1).sum()) if local_rows.numel() else 0

    # 1. Shapes, counts and NaN counts of every rank (one small fixed-size all_gather).
    header = torch.tensor([n, d, FLOAT_DTYPES.index(centres.dtype), local_idx.numel(), bad_rows],
                          dtype=torch.long, device=comm)
    headers = torch.stack(_all_gather_same(header, group)).tolist()
    if any(h[:3] != headers[0][:3] for h in headers):
        shapes = [f"rank {r}: N={h[0]}, D={h[1]}, dtype code {h[2]}" for r, h in enumerate(headers)]
        raise ValueError("the ranks' banks differ in size or dtype (" + "; ".join(shapes) + ")")
    nonfinite = [h[4] for h in headers]
    if sum(nonfinite):
        raise ValueError(f"the model produced NaN/inf embeddings for {sum(nonfinite)} rows "
                         f"(per rank: {nonfinite}); the bank was left unchanged")
    counts = [h[3] for h in headers]

    # 2. Every rank's (idx, label) pairs, then the owner of each row: the lowest rank with it.
    pairs = torch.stack([local_idx, centre_labels[local_idx].long()], 1)
    all_pairs = torch.empty(sum(counts), 2, dtype=torch.long, device=dev)
    _all_gather_rows(pairs, counts, _placer(all_pairs, [0, *itertools.accumulate(counts)]),
                     group, comm, chunk_bytes)
    got = list(all_pairs.split(counts))  # rows in 0..n-1: every rank's n is checked equal
    owner = torch.full((n,), w, dtype=torch.long, device=dev)
    new_labels = torch.empty(n, dtype=torch.long, device=dev)
    for r in reversed(range(w)):  # lower ranks overwrite higher ones: the lowest rank wins
        owner[got[r][:, 0]] = r
        new_labels[got[r][:, 0]] = got[r][:, 1]
    missing = int((owner == w).sum())
    if missing:
        first = (owner == w).nonzero()[:5].flatten().tolist()
        raise ValueError(f"no rank's loader yielded {missing} of the bank's {n} rows (first "
                         f"missing idx: {first}); give the refresh loader a DistributedSampler "
                         f"over the whole training set; the bank was left unchanged")
    for r in range(w):
        clash = new_labels[got[r][:, 0]] != got[r][:, 1]
        if bool(clash.any()):
            i = int(got[r][clash.nonzero()[0, 0], 0])
            raise ValueError(f"row {i} has label {int(new_labels[i])} on rank "
                             f"{int(owner[i])} but {int(got[r][clash, 1][0])} on rank {r}; the "
                             f"ranks' datasets differ")

    # 3. The centre rows, each sent by its owner only, in the owner's ascending idx order.
    owned = [g[:, 0][owner[g[:, 0]] == r] for r, g in enumerate(got)]
    mine = local_rows[owner[local_idx] == me]

    def place_rows(r: int, first: int, rows: Tensor) -> None:
        centres[owned[r][first:first + rows.shape[0]]] = rows.to(dev)

    _all_gather_rows(mine, [o.numel() for o in owned], place_rows, group, comm, chunk_bytes)
    centre_labels.copy_(new_labels)
    return centres, centre_labels


def _query_slice(n: int, r: int, w: int) -> Tuple[int, int]:
    """Rows [start, stop) of the N queries that rank r searches (sizes differ by at most 1)."""
    return r * n // w, (r + 1) * n // w


@torch.no_grad()
def neighbour_lists(centres: Tensor, centre_labels: Tensor, k: int, search_backend: str = "auto",
                    ensure_positive: bool = False, group=None,
                    chunk_bytes: int = GATHER_CHUNK_BYTES, **knn_options) -> NeighbourLists:
    """:func:`nnkloss.bank.search.neighbour_lists` with the queries split across ranks: every
    rank passes the same bank and returns the same lists (``seconds`` covers the exchange)."""
    if not is_distributed(group):
        return single_process_lists(centres, centre_labels, k, search_backend,
                                    ensure_positive=ensure_positive, **knn_options)
    n = require_labelled("centres", centres, "centre_labels", centre_labels)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n - 1:
        raise ValueError(f"k must be an int in [1, N - 1 = {n - 1}], got {k!r}")
    labels = centre_labels.to(centres.device).long()
    dev = centres.device
    w, me = world_size(group), rank(group)
    comm = comm_device(group, dev)
    used = search_name(search_backend, knn_options)
    synchronize(dev)
    t0 = time.perf_counter()
    start, stop = _query_slice(n, me, w)
    # This rank's rows against the full bank, own rows dropped.
    dist_, ids = knn(centres[start:stop], centres, min(k + 1, n), search_backend,
                     **knn_options)
    dist_, ids = drop_self(dist_, ids, torch.arange(start, stop, device=ids.device), k)
    nb_labels = labels[ids.clamp_min(0)]
    has_pos = ((nb_labels == labels[start:stop].unsqueeze(1)) & (ids >= 0)).any(1)
    patched = (patch_positives(centres, labels, start, dist_, ids, has_pos, search_backend,
                               knn_options) if ensure_positive and not bool(has_pos.all()) else 0)

    starts, stops = zip(*(_query_slice(n, r, w) for r in range(w)))
    counts = [b - a for a, b in zip(starts, stops)]
    outs = []
    for part, dtype in ((ids, torch.long), (dist_.float(), torch.float32),
                        (has_pos.to(torch.uint8), torch.bool)):
        outs.append(torch.empty((n,) + part.shape[1:], dtype=dtype, device=dev))
        _all_gather_rows(part, counts, _placer(outs[-1], starts), group, comm, chunk_bytes)
    total = torch.tensor([patched], dtype=torch.long, device=comm)
    dist.all_reduce(total, group=group)
    synchronize(dev)
    out_i, out_d, out_p = outs
    return NeighbourLists(out_d, out_i, out_p, int(total), time.perf_counter() - t0, used)
