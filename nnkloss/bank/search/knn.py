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
    """The search a ``search_backend`` runs: "auto" is "torch" (never dependent on faiss)."""
    check_search_backend(search_backend)
    return "torch" if search_backend == "auto" else search_backend


def iter_knn(queries: Tensor, base: Tensor, k: int, search_backend: str = "auto",
             exclude_self: bool = False, *, tile_bytes: Optional[int] = None
             ) -> Iterator[SearchBlock]:
    """Exact search as :func:`knn`, yielded as :class:`SearchBlock` per block of query rows;
    memory: one block's working set. Arguments are checked at the call."""
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
        blocks = iter_knn_torch(queries, base, k, tile_bytes,
                                self_search=same_tensor(queries, base),
                                exclude_self=exclude_self, out=out)
    for q0, dist, idx in blocks:
        if exclude_self and faiss:
            own = torch.arange(q0, q0 + idx.shape[0], device=idx.device)
            dist, idx = drop_self(dist, idx, own, k)
        yield SearchBlock(q0, dist, idx)


def check_search_arguments(search_backend, approximate, options: dict, arg: str = "{}") -> None:
    """:func:`knn`'s checks of backend, index kind, index options and faiss (ImportError),
    before any work; ``arg`` spells an option's name as the caller passed it."""
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
        search_backend: "torch" (tiled GEMM, any device), "faiss" (exact ``IndexFlatL2``) or
            "auto" (= "torch").
        exclude_self: the queries are the base rows (Q == N) and row i never returns i
            (duplicates still do). Pass one tensor as both for the faster self-search.
        approximate: None (exact), "ivf" (faiss ``IndexIVFFlat``) or "hnsw" (faiss
            ``IndexHNSWFlat``, CPU), with ``search_backend`` "auto" or "faiss".
        tile_bytes: the torch search's working memory (default: 256 MiB on the CPU, a quarter
            of the free memory on CUDA, at most 4 GiB).
        nlist, nprobe, train_size: IVF lists (default ~4 sqrt(N)), lists probed (default
            max(8, nlist/8)), training sample (default 256 nlist).
        hnsw_m, ef_construction, ef_search: HNSW degree, build and search beams (defaults
            32, 64, 64; the search beam at least 2k + 2).
        seed: of the IVF training sample and k-means (default 0).
        An index option of another index is a ValueError naming it.

    Returns:
        :class:`SearchResult` ``(distances, neighbours)``, both (Q, k) on the queries' device:
        fp32 squared L2 distances ascending, ties by index, and int64 rows of ``base`` (-1 at
        inf where an approximate search finds fewer than k). On CUDA "torch" follows PyTorch's
        TF32 setting.

    Raises:
        ValueError: bad k (naming it), empty base, NaN/inf or a row norm above 2**62 (naming
            the input), dimension or device mismatch, exclude_self with Q != N, an unknown or
            non-positive option.
        TypeError: non-tensor or non-float inputs, non-int k.
        ImportError: faiss needed but not installed (before any work).

    Empty queries give (0, k) results. The torch search never forms a Q x N matrix.
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
    # The compiled selection decodes straight into ``out``; other blocks are copied in.
    for q0, dist, idx in _iter_checked(queries, base, k, search_backend, exclude_self,
                                       tile_bytes, out):
        if not decoded_into(out, q0, dist, idx):
            out[0][q0:q0 + dist.shape[0]] = dist
            out[1][q0:q0 + idx.shape[0]] = idx
    return SearchResult(*out)
