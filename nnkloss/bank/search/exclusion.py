"""Self-exclusion: the one place where a query's own row leaves its neighbour list.

Every search that excludes self asks for ``k + 1`` neighbours and drops the own row where it is
among them, the last entry otherwise. The compiled CPU selection applies the same rule in its
decode.
"""
from __future__ import annotations

from typing import Tuple

import torch
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

    The order is kept: one ``where`` of two shifted views.
    """
    dist, ids = distances, neighbours
    q, width = ids.shape
    if width == 0 or q == 0:
        return dist[:, :k].contiguous(), ids[:, :k].contiguous()
    hit = ids == self_ids.to(ids.device).unsqueeze(1)
    # The own index's column, else the last.
    pos = torch.where(hit.any(dim=1), hit.to(torch.uint8).argmax(dim=1), width - 1)
    after = torch.arange(k, device=ids.device) >= pos.unsqueeze(1)  # (Q, k)
    return (torch.where(after, dist[:, 1:k + 1], dist[:, :k]),
            torch.where(after, ids[:, 1:k + 1], ids[:, :k]))
