"""The backward's embedding gradient on the GPU: one Triton kernel and its launcher.

The fused forward leaves grad_x[b] = dLoss_b/dx_b; the backward scales each row by g[b], the
gradient reaching its loss, under the op's row rule (nnkloss/ops/CONTRACT.md): a row without a
same-class neighbour or with g[b] = 0 passes no gradient on, even where grad_x is NaN. One
launch for torch's six; the twin of :func:`nnkloss.cpu.scale_rows`.

Memory traffic for a (B, D) grad_x: reads it and B x (sizeof(g) + sizeof(lse_pos)), one factor
and one flag a row; writes the B x D gradient in the embeddings' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .neighbour_kernel import cdiv, pow2_ceil

# Elements of one tile (rows x columns): 16 fp32 per thread at 4 warps, as the other kernels.
SCALE_ROWS_TILE = 2048
# Widest column block; wider rows take more programs along D (grid axis 1).
SCALE_ROWS_MAX_BLOCK_D = 1024


@triton.jit
def _scale_rows_kernel(
    gx_ptr, g_ptr, lse_pos_ptr, divisor_ptr, out_ptr,
    B, D,
    stride_gx, stride_g, stride_out,
    HAS_LSE_POS: tl.constexpr, DIVIDE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # 1. This program's rows and columns.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < B
    mask = rmask[:, None] & (cols < D)[None, :]
    # 2. Each row's factor (in grad_x's dtype, as torch casts it) and whether it takes one.
    g = tl.load(g_ptr + rows * stride_g, mask=rmask, other=0.0)
    if DIVIDE:  # a mean's gradient: g / divisor in the divisor's dtype, as torch divides it
        g = g / tl.load(divisor_ptr)
    g = g.to(gx_ptr.dtype.element_ty)
    takes = g != 0
    if HAS_LSE_POS:
        lse_pos = tl.load(lse_pos_ptr + rows, mask=rmask, other=float("-inf"))
        takes = takes & (lse_pos != float("-inf"))
    # 3. Scale, or 0 for a row that takes nothing (whatever grad_x holds there), and write.
    gx = tl.load(gx_ptr + rows[:, None] * stride_gx + cols[None, :], mask=mask, other=0.0)
    y = tl.where(takes[:, None], g[:, None] * gx, 0.0)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_config(D: int):
    """(block_r, block_d): up to SCALE_ROWS_MAX_BLOCK_D columns, rows fill the tile."""
    block_d = min(pow2_ceil(D), SCALE_ROWS_MAX_BLOCK_D)
    return max(1, SCALE_ROWS_TILE // block_d), block_d


def scale_rows(grad_x: torch.Tensor, g: torch.Tensor, lse_pos: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None,
               divisor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``g[:, None] * grad_x`` in ``out_dtype``, 0 in every row where ``g == 0`` or
    ``lse_pos == -inf``.

    Args:
        grad_x: (B, D) fp32/fp64, unit column stride.
        g: (B,) float, any stride (an expanded scalar too), or 0-dim (every row's).
        lse_pos: (B,) in grad_x's dtype, or None (then only ``g == 0`` rows are zeroed).
        out_dtype: the result's dtype (the embeddings'); default grad_x's.
        divisor: a 0-dim tensor or None: every row's factor is then ``g / divisor`` (a
            counted mean's gradient).
    """
    B, D = grad_x.shape
    out = torch.empty(B, D, dtype=out_dtype or grad_x.dtype, device=grad_x.device)
    if B == 0 or D == 0:
        return out
    if grad_x.stride(1) != 1:
        grad_x = grad_x.contiguous()
    if lse_pos is not None and lse_pos.stride(0) != 1:
        lse_pos = lse_pos.contiguous()
    block_r, block_d = scale_rows_config(D)
    grid = (cdiv(B, block_r), cdiv(D, block_d))
    _scale_rows_kernel[grid](
        grad_x, g, lse_pos if lse_pos is not None else grad_x,
        divisor if divisor is not None else grad_x, out,
        B, D,
        grad_x.stride(0), g.stride(0) if g.dim() else 0, out.stride(0),
        HAS_LSE_POS=lse_pos is not None, DIVIDE=divisor is not None, BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out
