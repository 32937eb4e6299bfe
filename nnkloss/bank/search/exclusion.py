"""Self-exclusion, the one rule: a search that excludes self asks for ``k + 1`` neighbours and
drops the own row where it is among them, the last entry otherwise (the compiled CPU
selection applies the same rule in its decode)."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["drop_self"]


def drop_self(distances: Tensor, neighbours: Tensor, self_ids: Tensor, k: int
              ) -> Tuple[Tensor, Tensor]:
    """``(distances, neighbours)`` (Q, k) without each row's own index ``self_ids`` (Q,),
    from (Q, k + 1) ascending results (padding -1 / inf at the end); order kept."""
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
