"""The value check of the gathered centres on the GPU: one Triton kernel and its launcher.

``nnkloss.validation.check_values`` refuses a call whose lists gather a NaN or inf centre
value. This kernel reads each listed row once and writes one flag (no (B x K, D) gather).

Memory traffic for ``n`` list entries: reads n x D x sizeof(bank) of listed rows (padding and
indices outside the bank read nothing) and the n entries; writes one int32 per program that
finds a non-finite value (usually none).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .neighbour_kernel import _gather_rows, _tl_dtype, cdiv, pow2_ceil, row_align

# Elements of one gathered tile (block_e x block_d): 16 fp32 per thread at 4 warps.
GATHERED_FINITE_TILE = 2048
# Widest D chunk of a tile; wider rows are tested chunk by chunk.
GATHERED_FINITE_MAX_BLOCK_D = 256


@triton.jit
def _gathered_finite_kernel(
    cen_ptr, idx_ptr, flag_ptr,
    n, N, D, stride_cn,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, ROW_ALIGN: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    # 1. This program's list entries; padding and entries outside the bank read nothing.
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < n
    idx = tl.load(idx_ptr + e, mask=emask, other=-1).to(tl.int64)
    listed = emask & (idx >= 0) & (idx < N)
    safe = tl.where(listed, idx, 0)
    Dc = (D // ROW_ALIGN) * ROW_ALIGN  # masks constant over whole vectors: wide loads
    bad = tl.zeros([BLOCK_E], dtype=tl.int32)
    # 2. Over D a chunk at a time: NaN (x != x) or infinite, tested in fp32 (a 2-byte inf or
    #    NaN widens to one), fp64 rows in fp64.
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        c = _gather_rows(cen_ptr, safe, listed, stride_cn, dd, dd < Dc, ROW_ALIGN, COMPUTE)
        nonfinite = (c != c) | (tl.abs(c) == float("inf"))
        bad += tl.sum(nonfinite.to(tl.int32), axis=1)
    # 3. One flag for the whole call: set by any program that saw a non-finite value.
    if tl.sum(bad, axis=0) > 0:
        tl.store(flag_ptr, 1)


def gathered_finite_config(D: int):
    """(block_e, block_d): D chunks of up to GATHERED_FINITE_MAX_BLOCK_D, entries fill it."""
    block_d = min(pow2_ceil(D), GATHERED_FINITE_MAX_BLOCK_D)
    return max(1, GATHERED_FINITE_TILE // block_d), block_d


def gathered_rows_finite(centres: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """0-dim bool on centres' device, without a host read: every centre row that
    ``neighbours`` lists is finite.

    Args:
        centres: (N, D) fp16/bf16/fp32/fp64 bank, unit column stride.
        neighbours: any shape of int32/int64 bank rows, -1 = padding (other negatives and
            rows >= N are the caller's to refuse: nothing is read for them here).
    """
    N, D = centres.shape
    # The entries at unit stride (reshape of a column slice gives a strided view).
    flat = neighbours.reshape(-1).contiguous()
    flag = torch.zeros(1, dtype=torch.int32, device=centres.device)
    n = flat.numel()
    if N == 0 or n == 0 or D == 0:
        return flag[0] == 0
    if centres.stride(1) != 1:
        centres = centres.contiguous()
    block_e, block_d = gathered_finite_config(D)
    _gathered_finite_kernel[(cdiv(n, block_e),)](
        centres, flat, flag, n, N, D, centres.stride(0),
        BLOCK_E=block_e, BLOCK_D=block_d, ROW_ALIGN=row_align(D, centres),
        COMPUTE=_tl_dtype(centres.dtype),
    )
    return flag[0] == 0
