"""Self-exclusion: the one place where a query's own row leaves its neighbour list.

Every search that must exclude self (exact torch or faiss, approximate indexes, the sharded
search, the same-class search of :func:`~.lists.patch_positives` and the evaluation metrics)
asks for ``k + 1`` neighbours, own row included, and passes them through :func:`drop_self`.
Searches return neighbours ordered by (distance, index), so this gives the ``k`` nearest
*other* rows in that order: when the own row is among the ``k + 1`` it is removed, and when it
is not (more than ``k`` exact duplicates tie ahead of it) the last entry goes.
"""
from __future__ import annotations

from typing import Tuple

from torch import Tensor

__all__ = ["drop_self"]


def drop_self(distances: Tensor, neighbours: Tensor, self_ids: Tensor, k: int
              ) -> Tuple[Tensor, Tensor]:
    """``(distances, neighbours)``, both (Q, k), without each row's own index.

    Args:
        distances, neighbours: (Q, k + 1) results of a search whose queries are base rows, in
            ascending order (any dtype; padding -1 / inf, if any, at the end).
        self_ids: (Q,) int64, the base row of each query.
        k: the list length to return (``ids.shape[1] - 1``, or fewer columns).

    The order of the remaining entries is kept (no re-sort): O(Q k) work.
    """
    dist, ids = distances, neighbours
    q, width = ids.shape
    if width == 0 or q == 0:
        return dist[:, :k], ids[:, :k]
    drop = ids == self_ids.to(ids.device).unsqueeze(1)
    # A row whose own index is absent drops its last entry instead (at most one per row is
    # dropped: an index appears once in a row).
    drop[:, -1] |= ~drop.any(dim=1)
    keep = ~drop
    dist = dist[keep].view(q, width - 1)[:, :k]
    ids = ids[keep].view(q, width - 1)[:, :k]
    return dist.contiguous(), ids.contiguous()
