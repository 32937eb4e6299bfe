"""The losses' mean over their counted rows on the GPU: one Triton kernel and its launcher.

``reduction="mean"`` divides the sum of the per-row losses by the number of counted rows (at
least 1; nnkloss/ops/CONTRACT.md). In torch that is four small launches (sum, count_nonzero,
clamp_min, div), each a host round trip; on a GPU the op's forward is bound by the host's
time, and those launches cost more of it than the op's own (docs/PERFORMANCE.md, "The GPU
figures"). Here they are one launch of one program: the rows are few (a batch), and one
program sums them in a fixed order, so the mean is the same from run to run (atomics across
programs would not be).

The launcher also writes the divisor, ``max(count, 1)`` as a float, for the backward (the
gradient of every row is ``g / divisor``, as torch's division gives it).

Memory traffic for B rows:
    reads   B x sizeof(per_row)     the per-row losses (fp32 or fp64)
            B x 1                   the counted flags (bool)
    writes  2 x sizeof(per_row)     the mean and the divisor
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

# Rows read per step of the program's walk: 16 fp32 a thread at 4 warps, as the other kernels.
COUNTED_MEAN_BLOCK = 2048
# Most rows the one-program walk takes (32 steps); above it the caller's torch form, whose
# reductions spread over the GPU, is the faster (the launches then cost little beside them).
COUNTED_MEAN_MAX_ROWS = 1 << 16


@triton.jit
def _counted_mean_kernel(
    loss_ptr, counted_ptr, mean_ptr, divisor_ptr,
    B,
    BLOCK: tl.constexpr,
):
    # 1. One program walks the rows a block at a time: the losses summed in their own dtype
    #    (fp32, or fp64 for fp64 rows, as torch's sum), the counted flags counted.
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=mean_ptr.dtype.element_ty)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for r0 in range(0, B, BLOCK):
        rows = r0 + offs
        mask = rows < B
        total += tl.load(loss_ptr + rows, mask=mask, other=0.0)
        count += tl.load(counted_ptr + rows, mask=mask, other=0).to(tl.int32)
    # 2. The mean over the counted rows: the sum (uncounted rows hold 0; a NaN row's NaN goes
    #    through) divided by the count, at least 1 (no counted row: the mean is 0).
    divisor = tl.maximum(tl.sum(count, axis=0), 1).to(mean_ptr.dtype.element_ty)
    tl.store(mean_ptr, tl.sum(total, axis=0) / divisor)
    tl.store(divisor_ptr, divisor)


def counted_mean(per_row: torch.Tensor,
                 counted: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, divisor)``: the sum of ``per_row`` divided by ``divisor = max(count, 1)``, the
    number of True entries of ``counted``; both 0-dim tensors of per_row's dtype on its device,
    without a host read.

    Args:
        per_row: (B,) fp32/fp64 per-row losses, B <= COUNTED_MEAN_MAX_ROWS (0 where a row is
            not counted, as every loss of the package leaves it).
        counted: (B,) bool, the rows the mean counts.
    """
    B = per_row.shape[0]
    if B > COUNTED_MEAN_MAX_ROWS:
        raise ValueError(f"per_row has {B} rows; counted_mean takes at most "
                         f"{COUNTED_MEAN_MAX_ROWS} (one program walks them)")
    mean = torch.empty((), dtype=per_row.dtype, device=per_row.device)
    divisor = torch.empty((), dtype=per_row.dtype, device=per_row.device)
    _counted_mean_kernel[(1,)](
        per_row.contiguous(), counted.contiguous().view(torch.uint8), mean, divisor, B,
        BLOCK=COUNTED_MEAN_BLOCK,
    )
    return mean, divisor
