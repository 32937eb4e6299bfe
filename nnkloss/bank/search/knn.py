"""The public k-nearest-neighbour search: :func:`knn` (whole result) and :func:`iter_knn`
(the same result block by block, for callers that reduce it as it comes, like the metrics)."""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .exclusion import drop_self
from .faiss_search import (build_approximate, build_flat, check_index_options,
                           iter_search_index, require_faiss, search_index)
from .torch_search import decoded_into, iter_knn_torch, same_tensor
from .validation import APPROXIMATE, check_search_backend, validate

__all__ = ["knn", "iter_knn", "check_search_arguments", "resolve_search_backend",
           "SearchResult", "SearchBlock"]


class SearchResult(NamedTuple):
    """What :func:`knn` returns: ``(distances, neighbours)``, both (Q, k), nearest first.

    distances: fp32 squared L2 distances, ascending (inf for a missing neighbour).
    neighbours: int64 rows of the base (-1 for a missing neighbour, approximate search only).
    """
    distances: Tensor
    neighbours: Tensor


class SearchBlock(NamedTuple):
    """One block of :func:`iter_knn`: the results of query rows ``row0 .. row0 + rows - 1``."""
    row0: int
    distances: Tensor
    neighbours: Tensor


def resolve_search_backend(search_backend: str, device: torch.device) -> str:
    """The exact implementation a ``search_backend`` runs: "auto" is always "torch", so that
    the neighbours never depend on whether faiss is installed (the torch search runs on every
    device and is at least as fast on the CPU; faiss runs when asked for by name)."""
    check_search_backend(search_backend)
    return "torch" if search_backend == "auto" else search_backend


def iter_knn(queries: Tensor, base: Tensor, k: int, search_backend: str = "auto",
             exclude_self: bool = False, *, tile_bytes: Optional[int] = None
             ) -> Iterator[SearchBlock]:
    """Exact search, yielded as :class:`SearchBlock` ``(row0, distances (rows, k), neighbours
    (rows, k))`` for consecutive blocks of query rows; arguments and results as in :func:`knn`.
    Memory: one block's working set (the tile budget), never the whole (Q, k) result."""
    # Not a generator itself: bad arguments are reported by the call, not the first next().
    check_search_backend(search_backend)
    k = validate(queries, base, k, exclude_self)
    return _iter_checked(queries, base, k, search_backend, exclude_self, tile_bytes)


def _iter_checked(queries: Tensor, base: Tensor, k: int, search_backend: str,
                  exclude_self: bool, tile_bytes: Optional[int],
                  out: Optional[Tuple[Tensor, Tensor]] = None) -> Iterator[SearchBlock]:
    used = resolve_search_backend(search_backend, queries.device)
    if queries.shape[0] == 0:
        return
    faiss = used == "faiss"
    if faiss:
        kk = k + int(exclude_self)  # the own row is searched for, then dropped below
        blocks = iter_search_index(build_flat(base, kk), queries, kk)
    else:
        # A search of one tensor against itself can compute each pair's distance once.
        blocks = iter_knn_torch(queries, base, k, tile_bytes,
                                self_search=same_tensor(queries, base),
                                exclude_self=exclude_self, out=out)
    for q0, dist, idx in blocks:
        if exclude_self and faiss:
            own = torch.arange(q0, q0 + idx.shape[0], device=idx.device)
            dist, idx = drop_self(dist, idx, own, k)
        yield SearchBlock(q0, dist, idx)


def check_search_arguments(search_backend, approximate, options: dict, arg: str = "{}") -> None:
    """:func:`knn`'s checks of what it searches with, before any work on the inputs (the
    Refresher makes them at construction): the backend, the index kind, its options (one of
    another kind would be ignored: refused) and faiss where needed (ImportError). ``arg``
    spells an option's name as the caller passed it (``"knn_options[{!r}]"``)."""
    if approximate not in APPROXIMATE:
        raise ValueError(f"{arg.format('approximate')} must be one of {APPROXIMATE}, got "
                         f"{approximate!r}")
    check_search_backend(search_backend)
    check_index_options(approximate, options, arg)
    if approximate is not None:
        asked = f"{arg.format('approximate')}={approximate!r}"
        if search_backend not in ("auto", "faiss"):
            raise ValueError(f"{asked} uses faiss indexes; search_backend must be 'auto' or "
                             f"'faiss', got {search_backend!r}")
        require_faiss(asked)


def knn(queries: Tensor, base: Tensor, k: int, search_backend: str = "auto",
        exclude_self: bool = False, approximate: Optional[str] = None, *,
        tile_bytes: Optional[int] = None, nlist: Optional[int] = None,
        nprobe: Optional[int] = None, hnsw_m: Optional[int] = None,
        ef_construction: Optional[int] = None, ef_search: Optional[int] = None,
        train_size: Optional[int] = None, seed: Optional[int] = None) -> SearchResult:
    """The ``k`` nearest base rows of every query row, by squared Euclidean distance.

    Args:
        queries, base: (Q, D) and (N, D) float tensors on one device (distances in fp32).
        k: neighbours per query, ``1 <= k <= N`` (``<= N - 1`` with ``exclude_self``).
        search_backend: "torch" (tiled GEMM, any device), "faiss" (exact ``IndexFlatL2``, on
            the GPU for CUDA inputs where faiss's GPU support works) or "auto" (= "torch",
            so that results never depend on whether faiss is installed).
        exclude_self: the queries ARE the base rows (Q must equal N) and row i never returns i
            (exact duplicates of it still do, at distance 0). Pass the same tensor as
            ``queries`` and ``base`` for a self-search: on the CPU the "torch" backend can then
            compute each pair's distance once (:mod:`.torch_search`).
        approximate: None (exact), "ivf" (faiss ``IndexIVFFlat``) or "hnsw" (faiss
            ``IndexHNSWFlat``, CPU), with ``search_backend`` "auto" or "faiss".
        tile_bytes: the torch search's working memory (default: 256 MiB on the CPU, a quarter
            of the free memory on CUDA, at most 4 GiB).
        nlist, nprobe, train_size: IVF lists (default ~4 sqrt(N), >= 39 points per list),
            lists probed per query (default max(8, nlist/8)), training sample (default
            256 nlist) -- more probes: higher recall, slower.
        hnsw_m, ef_construction, ef_search: HNSW graph degree (default 32), build beam
            (default 64), search beam (default 64, raised to at least 2k + 2).
        seed: seed of the IVF training sample and k-means (default 0).
        An index option given for an index that does not use it is a ValueError naming it.

    Returns:
        :class:`SearchResult` ``(distances, neighbours)``, both (Q, k) on the queries' device:
        fp32 squared L2 distances ascending, ties ordered by index, and int64 rows of ``base``
        (-1 at inf where an approximate search finds fewer than k). On CUDA the "torch"
        backend follows PyTorch's TF32 setting (off by default).

    Raises:
        ValueError: k < 1 or more than the candidates (naming ``k``); empty base; NaN/inf in
            ``queries`` or ``base``, or a row of norm above 2**62 (naming which); dimension or
            device mismatch; exclude_self with Q != N; an unknown search_backend, approximate
            or index option, or a non-positive one.
        TypeError: non-tensor or non-float inputs, non-int k.
        ImportError: search_backend="faiss" or an approximate index without faiss installed
            (before any work on the inputs).

    Empty queries give (0, k) results. The torch search never forms a Q x N matrix; faiss holds
    an fp32 copy of the base in its index.
    """
    options = {"nlist": nlist, "nprobe": nprobe, "train_size": train_size, "seed": seed,
               "hnsw_m": hnsw_m, "ef_construction": ef_construction, "ef_search": ef_search}
    check_search_arguments(search_backend, approximate, options)
    if approximate is not None:
        k = validate(queries, base, k, exclude_self)
        dev = queries.device
        if queries.shape[0] == 0:
            return SearchResult(torch.empty(0, k, dtype=torch.float32, device=dev),
                                torch.empty(0, k, dtype=torch.long, device=dev))
        kk = min(k + int(exclude_self), base.shape[0])
        index = build_approximate(base, approximate, nlist, nprobe, hnsw_m, ef_construction,
                                  ef_search, k, train_size, seed)
        dist, idx = search_index(index, queries, kk)
        if exclude_self:
            dist, idx = drop_self(dist, idx, torch.arange(queries.shape[0], device=dev), k)
        return SearchResult(dist, idx)
    k = validate(queries, base, k, exclude_self)
    q = queries.shape[0]
    out = (torch.empty(q, k, dtype=torch.float32, device=queries.device),
           torch.empty(q, k, dtype=torch.long, device=queries.device))
    # The compiled selection decodes each block straight into these rows (no block buffer,
    # no copy); blocks of the other paths are copied in.
    for q0, dist, idx in _iter_checked(queries, base, k, search_backend, exclude_self,
                                       tile_bytes, out):
        if not decoded_into(out, q0, dist, idx):
            out[0][q0:q0 + dist.shape[0]] = dist
            out[1][q0:q0 + idx.shape[0]] = idx
    return SearchResult(*out)
