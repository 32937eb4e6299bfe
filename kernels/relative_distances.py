"""The classifier's relative squared distances on the GPU: one Triton kernel and its launcher.

For query row q (x = x[q]), its list entries j (i = idx[q, j]) and its reference centre
r = ref[q] (the classifier's nearest centre)::

    rel[q, j] = ||x - c_i||^2 - ||x - c_r||^2 = (c_i - c_r) . (c_i + c_r - 2 x)

The product form keeps the difference precise for a query far from every centre: at |x| = 1e4
the two fp32 squared distances are ~1e8 with a spacing of 8, so subtracting them loses all of
what decides the vote, while each factor of the product is a difference of nearby values (the
reason is written out in nnkloss/evaluation/classifier.py, ``_sq_dist_minus_ref``; the CPU's
compiled library computes the same form, ``nnk_rel_sqdist``). One pass over the gathered rows,
accumulated over D in chunks, so the (Q, K, D) block that the torch form builds never exists.

Memory traffic per query row (what the kernel must move):
    reads   K x D x sizeof(bank)      the gathered centre rows (all but a few bytes of it)
            K x sizeof(idx)           the list
            D x (sizeof(x) + sizeof(bank)) + sizeof(ref)
                                      the query and its reference row, once per K tile
    writes  K x sizeof(compute)       rel

Indices must be bank rows in [0, N): the classifier's come from its own search or are checked
before they reach here (an index outside the bank would be read as memory, as in any gather).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .neighbour_kernel import (_aligned_row_offsets, _gather_rows, _tl_dtype, cdiv,
                               pow2_ceil, row_align, unit_column_stride)

# Elements of one gathered tile (block_k x block_d): 16 fp32 per thread at 4 warps, the
# forward's 64 bytes per thread; the build gate holds every build at >= 16 warps per SM.
REL_SQDIST_TILE = 2048
# Widest D chunk of a tile; wider rows are accumulated chunk by chunk.
REL_SQDIST_MAX_BLOCK_D = 256
# CUDA's grid limits: at most 2**31 - 1 programs along axis 0 and 65535 along axes 1 and 2.
# The grid is (Q, list tiles): at D >= 256 a tile holds 8 entries, so a list longer than
# 65535 * 8 = 524,280 entries would need more tiles than axis 1 allows and the launch would
# fail; such a result is computed by several launches (rel_sqdist_launches).
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
    # D as a multiple of ROW_ALIGN / X_ALIGN (row_align divides D) so that the column masks
    # are constant over whole vectors: what lets the gathers be 128-bit loads.
    Dc = (D // ROW_ALIGN) * ROW_ALIGN
    Dx = (D // X_ALIGN) * X_ALIGN
    # 2. Over D, a chunk at a time: the gathered tile, the reference row and 2x; the product
    #    form's partial dot products are summed into acc (no (K, D) values survive a chunk).
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
    """(block_k, block_d) of a launch: D chunks of up to REL_SQDIST_MAX_BLOCK_D columns, the
    rest of a REL_SQDIST_TILE-element tile along the list (at most the list's next power of
    two)."""
    block_d = min(pow2_ceil(D), REL_SQDIST_MAX_BLOCK_D)
    block_k = max(1, min(pow2_ceil(K), REL_SQDIST_TILE // block_d))
    return block_k, block_d


def rel_sqdist_launches(Q: int, K: int, D: int):
    """The launches of a (Q, K) result at width D: a list of ``(q0, q1, k0, k1, grid)``, each
    computing rows [q0, q1) x list entries [k0, k1) with ``grid`` = (q1 - q0, list tiles)
    within CUDA's limits (MAX_GRID_X, MAX_GRID_Y). One launch of grid (Q, cdiv(K, block_k))
    unless Q or the tiles exceed them; every launch has the block sizes of the whole
    (``rel_sqdist_config(K, D)``: one compiled kernel)."""
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
        # a part of the result: its rows' queries, references, lists and outputs, sliced (the
        # row strides stay those of the whole; x's alignment is that of its first row here)
        xs, ids, outs = x[q0:q1], idx[q0:q1, k0:k1], out[q0:q1, k0:k1]
        _rel_sqdist_kernel[grid](
            xs, centres, ids, ref[q0:q1], outs,
            k1 - k0, D,
            xs.stride(0), centres.stride(0), ids.stride(0), outs.stride(0),
            COMPUTE=_tl_dtype(cdt), BLOCK_K=block_k, BLOCK_D=block_d,
            ROW_ALIGN=row_align(D, centres), X_ALIGN=row_align(D, xs),
        )
    return out
