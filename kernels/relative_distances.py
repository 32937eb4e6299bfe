"""The classifier's relative squared distances on the GPU: one Triton kernel and its launcher.

For query row q (x = x[q]), its list entries j (i = idx[q, j]) and its reference centre
r = ref[q] (the classifier's nearest centre)::

    rel[q, j] = ||x - c_i||^2 - ||x - c_r||^2 = (c_i - c_r) . (c_i + c_r - 2 x)

The product form stays precise for a query far from every centre, where the two squared
distances would cancel (nnkloss/evaluation/classifier.py, ``_sq_dist_minus_ref``). Accumulated
over D in chunks: no (Q, K, D) block. Indices must be bank rows in [0, N) (not checked here).

Memory traffic per query row: reads K x (D x sizeof(bank) + sizeof(idx)), the list and its
centre rows, and once per K tile the query and reference rows; writes K x sizeof(compute).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .neighbour_kernel import (_aligned_row_offsets, _gather_rows, _tl_dtype, cdiv,
                               pow2_ceil, row_align, unit_column_stride)

# Elements of one gathered tile (block_k x block_d): 16 fp32 per thread at 4 warps.
REL_SQDIST_TILE = 2048
# Widest D chunk of a tile; wider rows are accumulated chunk by chunk.
REL_SQDIST_MAX_BLOCK_D = 256
# CUDA's grid limits on the grid (Q, list tiles); a larger result takes several launches.
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535


@triton.jit
def _rel_sqdist_kernel(
    x_ptr, cen_ptr, idx_ptr, ref_ptr, out_ptr,
    K, D,
    stride_x, stride_cn, stride_idx, stride_out,
    COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_ALIGN: tl.constexpr, X_ALIGN: tl.constexpr,
):
    # 1. This program: query row q, entries [kt * BLOCK_K, (kt + 1) * BLOCK_K) of its list.
    q = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = kk < K
    idx = tl.load(idx_ptr + q * stride_idx + kk, mask=kmask, other=0).to(tl.int64)
    r = tl.load(ref_ptr + q).to(tl.int64)
    x_row = x_ptr + _aligned_row_offsets(q, stride_x, X_ALIGN)
    r_row = cen_ptr + _aligned_row_offsets(r, stride_cn, ROW_ALIGN)
    acc = tl.zeros([BLOCK_K], dtype=COMPUTE)
    # Column masks constant over whole vectors (row_align divides D): 128-bit gathers.
    Dc = (D // ROW_ALIGN) * ROW_ALIGN
    Dx = (D // X_ALIGN) * X_ALIGN
    # 2. Over D, a chunk at a time: the product form's partial dot products, summed into acc.
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = dd < Dc
        c = _gather_rows(cen_ptr, idx, kmask, stride_cn, dd, dmask, ROW_ALIGN, COMPUTE)
        cr = tl.load(r_row + dd, mask=dmask, other=0.0).to(COMPUTE)
        two_x = 2.0 * tl.load(x_row + dd, mask=dd < Dx, other=0.0).to(COMPUTE)
        acc += tl.sum((c - cr[None, :]) * (c + cr[None, :] - two_x[None, :]), axis=1)
    # 3. One store per entry.
    tl.store(out_ptr + q * stride_out + kk, acc, mask=kmask)


def rel_sqdist_config(K: int, D: int):
    """(block_k, block_d): D chunks of up to REL_SQDIST_MAX_BLOCK_D, list entries fill it."""
    block_d = min(pow2_ceil(D), REL_SQDIST_MAX_BLOCK_D)
    block_k = max(1, min(pow2_ceil(K), REL_SQDIST_TILE // block_d))
    return block_k, block_d


def rel_sqdist_launches(Q: int, K: int, D: int):
    """The launches of a (Q, K) result at width D: ``(q0, q1, k0, k1, grid)`` for rows
    [q0, q1) x entries [k0, k1), each grid within MAX_GRID_X x MAX_GRID_Y, all with the block
    sizes of the whole (one compiled kernel)."""
    block_k, _ = rel_sqdist_config(K, D)
    rows, cols = MAX_GRID_X, MAX_GRID_Y * block_k
    out = []
    for q0 in range(0, Q, rows):
        q1 = min(Q, q0 + rows)
        for k0 in range(0, K, cols):
            k1 = min(K, k0 + cols)
            out.append((q0, q1, k0, k1, (q1 - q0, cdiv(k1 - k0, block_k))))
    return out


def rel_sqdist(x: torch.Tensor, centres: torch.Tensor, idx: torch.Tensor, ref: torch.Tensor,
               cdt: torch.dtype) -> torch.Tensor:
    """(Q, K) ``||x_q - c_i||^2 - ||x_q - c_r||^2`` for i = idx[q, :], r = ref[q], in ``cdt``.

    Args:
        x: (Q, D) fp16/bf16/fp32/fp64 queries, unit column stride.
        centres: (N, D) fp16/bf16/fp32/fp64 bank, unit column stride.
        idx: (Q, K) int32/int64 bank rows in [0, N). ref: (Q,) int32/int64 bank rows in [0, N).
        cdt: torch.float32 or torch.float64, the dtype of the arithmetic and of the result.
    """
    if cdt not in (torch.float32, torch.float64):
        raise ValueError(f"cdt must be torch.float32 or torch.float64, got {cdt}")
    Q, K = idx.shape
    D = x.shape[1]
    x, centres, idx = unit_column_stride(x, centres, idx)
    ref = ref.contiguous()
    out = torch.empty(Q, K, dtype=cdt, device=x.device)
    if out.numel() == 0:
        return out
    block_k, block_d = rel_sqdist_config(K, D)
    for q0, q1, k0, k1, grid in rel_sqdist_launches(Q, K, D):
        # a part of the result, sliced (x's alignment is that of its first row here)
        xs, ids, outs = x[q0:q1], idx[q0:q1, k0:k1], out[q0:q1, k0:k1]
        _rel_sqdist_kernel[grid](
            xs, centres, ids, ref[q0:q1], outs,
            k1 - k0, D,
            xs.stride(0), centres.stride(0), ids.stride(0), outs.stride(0),
            COMPUTE=_tl_dtype(cdt), BLOCK_K=block_k, BLOCK_D=block_d,
            ROW_ALIGN=row_align(D, centres), X_ALIGN=row_align(D, xs),
        )
    return out
