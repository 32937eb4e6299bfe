"""The backward's per-entry terms on the GPU: one Triton kernel and its launcher.

For list entry j of row b, dl_j = (p_j - p^R_j) g_b (docs/MATHS.md section 3), with the logits
l_j = log w_j - u_j / 2 from the distances the forward saved. The kernel writes:

    coef[b, j] = dl_j / sigma^2            the centre gradient's coefficients (centre_grad)
    q[b, j]    = dl_j / w_j                the weight gradient's terms; at a zero weight the
                                           one-sided exp(-u_j/2 - lse_all) - [same class]
                                           exp(-u_j/2 - lse_pos), in one piece
    srow[b]    = sum_j dl_j (u_j - u_ref)  sigma's gradient is sum_b srow[b] / sigma; u_ref, the
                                           largest logit's distance, only eases cancellation

The twin of :func:`nnkloss.cpu.entry_grads`, with its row rules: a row without a same-class
entry or with g 0 gets zeros; a non-finite row that takes a gradient gets NaN.

Memory traffic per row: reads 2 x K x (sizeof(u) + sizeof(idx) + sizeof(label) [+ 4 weight]),
two passes over the list (the second from L2), and a few scalars; writes K x sizeof(compute)
for coef and for q, each when asked, and one value for srow.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .neighbour_kernel import _entry_meta, _list_entries, _online_update, _tl_dtype, pow2_ceil

# List entries per tile: one program per row, two passes over its list.
ENTRY_GRADS_MAX_BLOCK_K = 512


@triton.jit
def _expm1(x):
    """exp(x) - 1 to a few ulps near 0 (Kahan's form): where the direct difference would
    cancel, as it does for lse_pos - lse_all ~ 0 (almost all of a row's mass same-class)."""
    e = tl.exp(x)
    em1 = (e - 1.0) * x / tl.log(tl.where(e == 1.0, 2.0, e))
    return tl.where(e == 1.0, x, tl.where(e - 1.0 == -1.0, -1.0, em1))


@triton.jit
def _row_logits(u_ptr, nbr_ptr, clab_ptr, w_ptr, row, stride_u, stride_nb, kk, K, N, label,
                HAS_W: tl.constexpr, COMPUTE: tl.constexpr):
    """One tile of the row's list: its logits (-inf where not valid) and what the terms need."""
    kmask, nonpad, past, safe, valid, same, logw = _entry_meta(
        _list_entries(nbr_ptr, row, stride_nb, kk, K), clab_ptr, w_ptr, kk, K, N, label, HAS_W,
        COMPUTE)
    u = tl.load(u_ptr + row * stride_u + kk, mask=kmask, other=0.0).to(COMPUTE)
    logits = tl.where(valid, logw - 0.5 * u, float("-inf"))
    return kmask, nonpad, nonpad & ~past, safe, valid, same, u, logits


@triton.jit
def _entry_grads_kernel(
    u_ptr, nbr_ptr, lab_ptr, clab_ptr, w_ptr, lse_all_ptr, lse_pos_ptr, g_ptr, sigma_ptr,
    coef_ptr, q_ptr, srow_ptr,
    K, N, stride_u, stride_nb, stride_g, stride_out,
    HAS_W: tl.constexpr, NEED_C: tl.constexpr, NEED_Q: tl.constexpr, NEED_S: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # 1. The row: its log-sum-exps, the gradient reaching it and whether it takes one (no
    #    same-class entry: none; a non-finite row: NaN where it does).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    label = tl.load(lab_ptr + row)
    la = tl.load(lse_all_ptr + row).to(COMPUTE)
    lp = tl.load(lse_pos_ptr + row).to(COMPUTE)
    g = tl.load(g_ptr + row * stride_g).to(COMPUTE)
    g = tl.where(lp != float("-inf"), g, 0.0)
    takes = g != 0.0
    nan_row = takes & (lp != lp)
    sigma = tl.load(sigma_ptr).to(COMPUTE)
    inv_s2 = (1.0 / sigma) * (1.0 / sigma)
    zero = tl.sum(tl.zeros([BLOCK_K], dtype=COMPUTE), axis=0)
    # 2. First pass: both sums' running maxima and sums (the forward's online log-sum-exp),
    #    and the distance of the first largest logit (sigma's reference).
    m_all = zero + float("-inf")
    s_all = zero
    m_pos = zero + float("-inf")
    s_pos = zero
    best = zero + float("-inf")
    u_ref = zero
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs
        kmask, nonpad, inbank, safe, valid, same, u, logits = _row_logits(
            u_ptr, nbr_ptr, clab_ptr, w_ptr, row, stride_u, stride_nb, kk, K, N, label, HAS_W,
            COMPUTE)
        m_all, _, _, s_all = _online_update(m_all, s_all, logits)
        m_pos, _, _, s_pos = _online_update(m_pos, s_pos, tl.where(same, logits, float("-inf")))
        if NEED_S:
            t_max = tl.max(logits, axis=0)
            t_arg = tl.argmax(logits, axis=0, tie_break_left=True)
            newer = t_max > best
            u_ref = tl.where(newer, tl.sum(tl.where(offs == t_arg, u, 0.0), axis=0), u_ref)
            best = tl.where(newer, t_max, best)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    m_pos = tl.where(m_pos == float("-inf"), 0.0, m_pos)
    s_all = tl.where(s_all > 0, s_all, 1.0)
    s_pos = tl.where(s_pos > 0, s_pos, 1.0)
    # 3. Second pass: dl per entry, and what each gradient asked for.
    acc = zero
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs
        kmask, nonpad, inbank, safe, valid, same, u, logits = _row_logits(
            u_ptr, nbr_ptr, clab_ptr, w_ptr, row, stride_u, stride_nb, kk, K, N, label, HAS_W,
            COMPUTE)
        p_all = tl.exp(logits - m_all) / s_all
        p_pos = tl.exp(tl.where(same, logits, float("-inf")) - m_pos) / s_pos
        diff = p_all - p_pos
        dl = tl.where(takes, diff * g, 0.0)
        dl = tl.where(nan_row, float("nan"), dl)
        if NEED_C:
            tl.store(coef_ptr + row * stride_out + kk, dl * inv_s2, mask=kmask)
        if NEED_S:
            acc += tl.sum(tl.where(valid, dl * (u - u_ref), 0.0), axis=0)
        if NEED_Q:
            # An entry past the bank reads nothing (CONTRACT.md 9): its row and q are NaN.
            w = tl.load(w_ptr + safe, mask=inbank, other=1.0).to(COMPUTE)
            clab = tl.load(clab_ptr + safe, mask=inbank, other=0)
            at_zero_w = nonpad & (w == 0.0)
            base = -0.5 * u
            one_sided = tl.where(clab == label,
                                 -tl.exp(base - lp + tl.log(-_expm1(lp - la))),
                                 tl.exp(base - la))
            q = tl.where(at_zero_w, one_sided, diff / tl.where(at_zero_w, 1.0, w))
            q = tl.where(takes, q * g, 0.0)
            q = tl.where(nan_row, float("nan"), q)
            tl.store(q_ptr + row * stride_out + kk, tl.where(nonpad, q, 0.0), mask=kmask)
    if NEED_S:
        # a row that takes nothing: 0, whatever 0 x (a non-finite u_j - u_ref) gave
        tl.store(srow_ptr + row, tl.where(nan_row, float("nan"), tl.where(takes, acc, 0.0)))


def entry_grads_config(K: int):
    """(block_k, num_warps): tiles of up to ENTRY_GRADS_MAX_BLOCK_K, no idle warps."""
    block_k = min(pow2_ceil(K), ENTRY_GRADS_MAX_BLOCK_K)
    return block_k, max(1, min(4, block_k // 32))


def entry_grads(u: torch.Tensor, labels: torch.Tensor, centre_labels: torch.Tensor,
                neighbours: torch.Tensor, weights: Optional[torch.Tensor], lse_all: torch.Tensor,
                lse_pos: torch.Tensor, g: torch.Tensor, sigma: torch.Tensor, need_coef: bool,
                need_q: bool, need_srow: bool):
    """``(coef, q, srow)``: coef and q (B, K), srow (B,), in u's dtype, each None unless asked
    for (q also None without weights), as :func:`nnkloss.cpu.entry_grads`.

    Args:
        u: (B, K) fp32/fp64 scaled distances saved by the forward (0 at padding).
        labels: (B,) int32/int64; centre_labels: (N,) int32/int64.
        neighbours: (B, K) int32/int64, -1 = padding.
        weights: (N,) float or None.
        lse_all, lse_pos: (B,) the forward's log-sum-exps.
        g: (B,) the gradient reaching each row's loss, any stride (an expanded scalar too).
        sigma: 0-dim float tensor on u's device (read on the device: no host sync).
    """
    B, K = u.shape
    cdt = u.dtype
    dev = u.device
    coef = torch.empty(B, K, dtype=cdt, device=dev) if need_coef else None
    q = torch.empty(B, K, dtype=cdt, device=dev) if need_q and weights is not None else None
    srow = torch.empty(B, dtype=cdt, device=dev) if need_srow else None
    if B == 0 or (coef is None and q is None and srow is None):
        return coef, q, srow
    u = u.contiguous()
    neighbours = neighbours.contiguous()
    lse_all = lse_all.to(cdt).contiguous()
    lse_pos = lse_pos.to(cdt).contiguous()
    block_k, num_warps = entry_grads_config(K)
    _entry_grads_kernel[(B,)](  # u: a pointer for what is not asked for (compiled out)
        u, neighbours, labels.contiguous(), centre_labels.contiguous(),
        weights if weights is not None else u, lse_all, lse_pos, g, sigma,
        coef if coef is not None else u, q if q is not None else u,
        srow if srow is not None else u,
        K, centre_labels.shape[0], u.stride(0), neighbours.stride(0), g.stride(0), K,
        HAS_W=weights is not None, NEED_C=coef is not None, NEED_Q=q is not None,
        NEED_S=srow is not None, COMPUTE=_tl_dtype(cdt), BLOCK_K=block_k, num_warps=num_warps,
    )
    return coef, q, srow
