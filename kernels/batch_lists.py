"""A batch's neighbour lists on the GPU: one Triton kernel and its launcher.

``nnkloss.losses.BankLoss`` starts every call from the bank's (N, K) lists table: the batch's
rows, each example's own index replaced by -1, and the lists of rows whose label disagrees
with the bank's emptied (dropped: loss 0, no gradient, out of the mean) and counted, in one
launch. Rows whose ``idx`` lies outside the bank read nothing and are counted apart, so that
a caller can name ``idx`` (torch's gather would assert).

Memory traffic for B rows of K entries of ``s`` bytes: reads B x K x s of the table (none for a
dropped row), B x (idx + label) and each row's bank label; writes the B x K x s lists, and two
int64 counts only from programs that drop a row (usually none).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .neighbour_kernel import cdiv, pow2_ceil, ticket

# Entries of one tile (rows x list entries): 8 a thread at 4 warps.
BATCH_LISTS_TILE = 1024
# Widest chunk of a list; longer lists are copied chunk by chunk.
BATCH_LISTS_MAX_BLOCK_K = 256


@triton.jit
def _batch_lists_kernel(
    table_ptr, idx_ptr, labels_ptr, bank_labels_ptr, out_ptr, counts_ptr, ticket_ptr,
    B, N, K, stride_t,
    EXCLUDE_SELF: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # 1. This program's rows and their bank rows. An idx outside [0, N) reads nothing.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    i = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    in_bank = (i >= 0) & (i < N)
    # 2. A row is dropped when its idx is outside the bank or its label is not its bank row's.
    label = tl.load(labels_ptr + rows, mask=rmask, other=0).to(tl.int64)
    own = tl.load(bank_labels_ptr + i, mask=rmask & in_bank, other=0).to(tl.int64)
    drop = rmask & ((~in_bank) | (own != label))
    keep = rmask & ~drop
    # 3. The lists, a chunk at a time: a kept row's entries (its own index -1 when excluded),
    #    a dropped row's all -1.
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        nb = tl.load(table_ptr + i[:, None] * stride_t + kk[None, :],
                     mask=keep[:, None] & kmask[None, :], other=-1)
        if EXCLUDE_SELF:
            nb = tl.where(nb == i[:, None], -1, nb)
        tl.store(out_ptr + rows[:, None] * K + kk[None, :], nb,
                 mask=rmask[:, None] & kmask[None, :])
    # 4. The counts (dropped rows, those outside the bank), added into the ticket's two
    #    accumulators; the last program moves them to counts and leaves the ticket at 0.
    n_drop = tl.sum(drop.to(tl.int32), axis=0)
    if n_drop > 0:
        tl.atomic_add(ticket_ptr + 1, n_drop, sem="acq_rel")
        tl.atomic_add(ticket_ptr + 2, tl.sum((rmask & ~in_bank).to(tl.int32), axis=0),
                      sem="acq_rel")
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(counts_ptr, tl.atomic_xchg(ticket_ptr + 1, 0).to(tl.int64))
        tl.store(counts_ptr + 1, tl.atomic_xchg(ticket_ptr + 2, 0).to(tl.int64))
        tl.atomic_xchg(ticket_ptr, 0)


def batch_lists_config(K: int) -> Tuple[int, int]:
    """(block_b, block_k): list chunks of up to BATCH_LISTS_MAX_BLOCK_K, rows fill the tile."""
    block_k = min(pow2_ceil(K), BATCH_LISTS_MAX_BLOCK_K)
    return max(1, BATCH_LISTS_TILE // block_k), block_k


def batch_lists(table: torch.Tensor, idx: torch.Tensor, labels: torch.Tensor,
                bank_labels: torch.Tensor, exclude_self: bool
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lists, counts)`` of a batch, without a host read.

    Args:
        table: (N, K) int32/int64 lists of the bank (-1 = padding), unit column stride.
        idx, labels: (B,) integer bank rows and labels of the batch.
        bank_labels: (N,) integer labels of the bank's rows.
        exclude_self: replace each row's own index in its list by -1.

    Returns:
        lists: (B, K) in the table's dtype: ``table[idx[b]]``, all -1 for a dropped row.
        counts: (2,) int64: rows dropped (label not the bank row's, or idx outside [0, N)),
            and those of them whose idx is outside [0, N).
    """
    N, K = table.shape
    B = idx.shape[0]
    out = torch.empty(B, K, dtype=table.dtype, device=table.device)
    counts = torch.empty(2, dtype=torch.int64, device=table.device)
    if B == 0:
        return out, counts.zero_()
    if table.stride(1) != 1:
        table = table.contiguous()
    block_b, block_k = batch_lists_config(K)
    _batch_lists_kernel[(cdiv(B, block_b),)](
        table, idx.contiguous(), labels.contiguous(), bank_labels.contiguous(), out, counts,
        ticket(table.device, 1), B, N, K, table.stride(0),
        EXCLUDE_SELF=bool(exclude_self), BLOCK_B=block_b, BLOCK_K=block_k,
    )
    return out, counts
