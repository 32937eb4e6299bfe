"""Fused nearest-neighbour Gaussian kernel loss: Triton kernels and their launchers.

This module knows nothing of banks, training or autograd: it takes plain tensors and returns
plain tensors. The maths (per query row ``b`` with label ``R`` and neighbour list ``N_b``)::

    d_j   = ||x_b - c_j||^2
    l_j   = log w_j - d_j / (2 sigma^2)
    S     = logsumexp_{j in N_b} l_j          S_R = logsumexp_{j in N_b, y_j = R} l_j
    loss  = S - S_R
    dL/dx = (1/sigma^2) * (sum_j p_j (c_j - x) - sum_j p^R_j (c_j - x))

The forward kernel streams the K neighbours of a row in tiles of ``[BLOCK_K, D]`` and keeps two
online-softmax accumulators (all neighbours / same-class neighbours), each with its own running
max so that neither sum underflows when positives are much farther than negatives. Every gathered
centre row is read once from memory. Its outputs are everything the backward pass needs, so the
backward is only B x K / B x D elementwise work (plus :func:`centre_grad` when centres need a
gradient).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

# Largest power-of-two D held in registers for the single-pass path; larger D uses the
# two-phase path (distances first, then the weighted sums chunk by chunk over D).
MAX_SINGLE_PASS_BLOCK_D = 4096
# Elements of one [BLOCK_K, BLOCK_D] centre tile kept in registers.
TILE_ELEMS = 8192


@triton.jit
def _online_update(m, s, logits, new_max_candidate):
    """One online-logsumexp step: returns (new max, rescale factor, exp weights, new sum)."""
    m_new = tl.maximum(m, new_max_candidate)
    # While nothing valid has been seen m_new is -inf; shift by 0 instead so that
    # exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe)
    s_new = s * alpha + tl.sum(p, axis=0)
    return m_new, alpha, p, s_new


@triton.jit
def _lse(m, s):
    return tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf"))


@triton.jit
def _nk_fwd_kernel(
    emb_ptr, lab_ptr, cen_ptr, clab_ptr, nbr_ptr, w_ptr, sigma_ptr,
    loss_ptr, lse_all_ptr, lse_pos_ptr, gx_ptr, dist_ptr,
    K, D,
    stride_eb, stride_cn, stride_nb, stride_gb, stride_db,
    HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sigma = tl.load(sigma_ptr).to(COMPUTE)
    inv_s2 = 1.0 / (sigma * sigma)
    half_inv_s2 = 0.5 * inv_s2
    label = tl.load(lab_ptr + row)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)

    zero = tl.sum(tl.zeros([BLOCK_K], dtype=COMPUTE), axis=0)
    m_all = zero + float("-inf")
    s_all = zero
    m_pos = zero + float("-inf")
    s_pos = zero
    acc_all = tl.zeros([BLOCK_D], dtype=COMPUTE)
    acc_pos = tl.zeros([BLOCK_D], dtype=COMPUTE)
    if SINGLE_PASS:
        dmask = offs_d < D
        x = tl.load(emb_ptr + row * stride_eb + offs_d, mask=dmask, other=0.0).to(COMPUTE)

    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        idx = tl.load(nbr_ptr + row * stride_nb + kk, mask=kmask, other=-1).to(tl.int64)
        nonpad = kmask & (idx >= 0)
        safe = tl.where(nonpad, idx, 0)
        clab = tl.load(clab_ptr + safe, mask=nonpad, other=0)
        if HAS_W:
            w = tl.load(w_ptr + safe, mask=nonpad, other=0.0).to(COMPUTE)
            valid = nonpad & (w > 0)
            logw = tl.log(tl.where(valid, w, 1.0))
        else:
            valid = nonpad
            logw = tl.zeros([BLOCK_K], dtype=COMPUTE)
        # Distances of zero-weight entries are still computed: the weight gradient needs them.
        if SINGLE_PASS:
            c = tl.load(cen_ptr + safe[:, None] * stride_cn + offs_d[None, :],
                        mask=nonpad[:, None] & dmask[None, :], other=0.0).to(COMPUTE)
            diff = tl.where(nonpad[:, None], c - x[None, :], 0.0)
            dist = tl.sum(diff * diff, axis=1)
        else:
            dist = tl.zeros([BLOCK_K], dtype=COMPUTE)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                dm = dd < D
                xc = tl.load(emb_ptr + row * stride_eb + dd, mask=dm, other=0.0).to(COMPUTE)
                cc = tl.load(cen_ptr + safe[:, None] * stride_cn + dd[None, :],
                             mask=nonpad[:, None] & dm[None, :], other=0.0).to(COMPUTE)
                df = tl.where(nonpad[:, None], cc - xc[None, :], 0.0)
                dist += tl.sum(df * df, axis=1)
        tl.store(dist_ptr + row * stride_db + kk, dist, mask=kmask)

        logit = tl.where(valid, logw - dist * half_inv_s2, float("-inf"))
        logit_pos = tl.where(valid & (clab == label), logit, float("-inf"))
        m_all, alpha_all, p_all, s_all = _online_update(m_all, s_all, logit, tl.max(logit, axis=0))
        m_pos, alpha_pos, p_pos, s_pos = _online_update(m_pos, s_pos, logit_pos,
                                                        tl.max(logit_pos, axis=0))
        if SINGLE_PASS:
            acc_all = acc_all * alpha_all + tl.sum(p_all[:, None] * diff, axis=0)
            acc_pos = acc_pos * alpha_pos + tl.sum(p_pos[:, None] * diff, axis=0)

    lse_all = _lse(m_all, s_all)
    lse_pos = _lse(m_pos, s_pos)
    has_pos = s_pos > 0
    tl.store(lse_all_ptr + row, lse_all)
    tl.store(lse_pos_ptr + row, lse_pos)
    tl.store(loss_ptr + row, tl.where(has_pos, lse_all - lse_pos, 0.0))

    # Rows with no same-class neighbour get zero gradient: scale both means by 0.
    scale_all = tl.where(has_pos, inv_s2 / tl.where(s_all > 0, s_all, 1.0), 0.0)
    scale_pos = tl.where(has_pos, inv_s2 / tl.where(has_pos, s_pos, 1.0), 0.0)
    if SINGLE_PASS:
        gx = acc_all * scale_all - acc_pos * scale_pos
        tl.store(gx_ptr + row * stride_gb + offs_d, gx, mask=dmask)
    else:
        # Two-phase path for wide D: the exact probabilities are known now, so the weighted
        # centre sums need no rescaling. Make this program's distance stores visible first.
        tl.debug_barrier()
        lse_all_safe = tl.where(s_all > 0, lse_all, 0.0)
        lse_pos_safe = tl.where(has_pos, lse_pos, 0.0)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            dm = dd < D
            xc = tl.load(emb_ptr + row * stride_eb + dd, mask=dm, other=0.0).to(COMPUTE)
            g = tl.zeros([BLOCK_D], dtype=COMPUTE)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                kmask = kk < K
                idx = tl.load(nbr_ptr + row * stride_nb + kk, mask=kmask, other=-1).to(tl.int64)
                valid = kmask & (idx >= 0)
                safe = tl.where(valid, idx, 0)
                clab = tl.load(clab_ptr + safe, mask=valid, other=0)
                if HAS_W:
                    w = tl.load(w_ptr + safe, mask=valid, other=0.0).to(COMPUTE)
                    valid = valid & (w > 0)
                    logw = tl.log(tl.where(valid, w, 1.0))
                else:
                    logw = tl.zeros([BLOCK_K], dtype=COMPUTE)
                dist = tl.load(dist_ptr + row * stride_db + kk, mask=kmask, other=0.0)
                logit = logw - dist * half_inv_s2
                # Any valid entry implies s_all > 0; rows without positives are zeroed by coef.
                p_all = tl.where(valid, tl.exp(logit - lse_all_safe), 0.0)
                p_pos = tl.where(valid & (clab == label), tl.exp(logit - lse_pos_safe), 0.0)
                coef = tl.where(has_pos, (p_all - p_pos) * inv_s2, 0.0)
                cc = tl.load(cen_ptr + safe[:, None] * stride_cn + dd[None, :],
                             mask=valid[:, None] & dm[None, :], other=0.0).to(COMPUTE)
                df = tl.where(valid[:, None], cc - xc[None, :], 0.0)
                g += tl.sum(coef[:, None] * df, axis=0)
            tl.store(gx_ptr + row * stride_gb + dd, g, mask=dm)


@triton.jit
def _nk_centre_grad_kernel(
    emb_ptr, cen_ptr, nbr_ptr, coef_ptr, gcen_ptr,
    K, D,
    stride_eb, stride_cn, stride_nb, stride_fb, stride_gn,
    COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grad_centres[j] += coef[b, k] * (x_b - c_j) for every (b, k) with neighbours[b, k] = j."""
    row = tl.program_id(0).to(tl.int64)
    dblock = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    dd = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = dd < D
    x = tl.load(emb_ptr + row * stride_eb + dd, mask=dm, other=0.0).to(COMPUTE)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        idx = tl.load(nbr_ptr + row * stride_nb + kk, mask=kmask, other=-1).to(tl.int64)
        coef = tl.load(coef_ptr + row * stride_fb + kk, mask=kmask, other=0.0).to(COMPUTE)
        valid = kmask & (idx >= 0) & (coef != 0)
        safe = tl.where(valid, idx, 0)
        m2 = valid[:, None] & dm[None, :]
        c = tl.load(cen_ptr + safe[:, None] * stride_cn + dd[None, :], mask=m2, other=0.0)
        contrib = coef[:, None] * (x[None, :] - c.to(COMPUTE))
        tl.atomic_add(gcen_ptr + safe[:, None] * stride_gn + dd[None, :], contrib, mask=m2)


def _compute_dtype(emb: torch.Tensor) -> torch.dtype:
    return torch.float64 if emb.dtype == torch.float64 else torch.float32


def _tl_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@dataclass(frozen=True)
class FwdConfig:
    """Launch configuration of the forward kernel.

    block_k: neighbours per tile (power of two); block_d: columns per tile (power of two; the
    single-pass path when it covers D); num_warps / num_stages: as for any Triton launch.
    """
    block_k: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2

    def single_pass(self, D: int) -> bool:
        return self.block_d >= D


def default_config(K: int, D: int, max_block_d: int = MAX_SINGLE_PASS_BLOCK_D) -> FwdConfig:
    """Heuristic choice (not yet tuned on a GPU): the whole row in registers up to
    ``max_block_d`` columns, about TILE_ELEMS elements per centre tile."""
    block_d_full = triton.next_power_of_2(max(D, 1))
    block_d = block_d_full if block_d_full <= max_block_d else max_block_d
    block_k = max(1, min(triton.next_power_of_2(max(K, 1)), TILE_ELEMS // block_d, 64))
    num_warps = 4 if block_k * block_d <= 2048 else 8
    return FwdConfig(block_k, block_d, num_warps)


def neighbour_kernel_fwd(emb, labels, centres, centre_labels, neighbours, weights, sigma,
                         max_block_d: int = MAX_SINGLE_PASS_BLOCK_D,
                         config: Optional[FwdConfig] = None):
    """Launch the fused forward.

    Args:
        emb: (B, D) fp16/bf16/fp32/fp64, row stride arbitrary, unit column stride.
        labels: (B,) integer. centres: (N, D) fp16/bf16/fp32/fp64, unit column stride.
        centre_labels: (N,) integer, same dtype as ``labels``.
        neighbours: (B, K) int32/int64, ``-1`` = padding, unit column stride.
        weights: (N,) float or None (all ones). sigma: 0-dim float tensor on the same device.
        max_block_d: widest D block kept in registers (tests lower it to reach the two-phase path).
        config: explicit launch configuration (benchmarks/tune_loss.py sweeps these); default
            :func:`default_config`.

    Returns:
        loss (B,), lse_all (B,), lse_pos (B,), grad_x (B, D) = dLoss_b/dx_b, dist (B, K); all in
        the compute dtype (fp64 for fp64 ``emb``, else fp32). Rows with no same-class neighbour
        have loss 0, lse_pos -inf and grad_x 0. ``dist`` holds squared distances of every
        non-padding entry (zero-weight ones too) and 0 for padding.
    """
    B, D = emb.shape
    K = neighbours.shape[1]
    cdt = _compute_dtype(emb)
    dev = emb.device
    loss = torch.empty(B, device=dev, dtype=cdt)
    lse_all = torch.empty(B, device=dev, dtype=cdt)
    lse_pos = torch.empty(B, device=dev, dtype=cdt)
    grad_x = torch.empty(B, D, device=dev, dtype=cdt)
    dist = torch.empty(B, K, device=dev, dtype=cdt)
    if B == 0:
        return loss, lse_all, lse_pos, grad_x, dist
    cfg = config if config is not None else default_config(K, D, max_block_d)
    for name in ("block_k", "block_d"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")
    w = weights if weights is not None else centres  # dummy pointer when HAS_W is False
    _nk_fwd_kernel[(B,)](
        emb, labels, centres, centre_labels, neighbours, w, sigma,
        loss, lse_all, lse_pos, grad_x, dist,
        K, D,
        emb.stride(0), centres.stride(0), neighbours.stride(0), grad_x.stride(0), dist.stride(0),
        HAS_W=weights is not None, COMPUTE=_tl_dtype(cdt),
        BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d, SINGLE_PASS=cfg.single_pass(D),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return loss, lse_all, lse_pos, grad_x, dist


def centre_grad(emb, centres, neighbours, coef):
    """Scatter ``coef[b, k] * (emb[b] - centres[neighbours[b, k]])`` into an (N, D) gradient.

    Args:
        emb: (B, D) float; centres: (N, D) float; neighbours: (B, K) int, -1 = padding;
        coef: (B, K) float, contiguous (zero entries are skipped).

    Returns:
        (N, D) gradient in the compute dtype (fp64 for fp64 ``emb``, else fp32).
    """
    B, D = emb.shape
    N = centres.shape[0]
    K = neighbours.shape[1]
    cdt = _compute_dtype(emb)
    grad = torch.zeros(N, D, device=emb.device, dtype=cdt)
    if B == 0 or N == 0:
        return grad
    block_d = min(triton.next_power_of_2(max(D, 1)), 256)
    block_k = max(1, min(triton.next_power_of_2(K), 4096 // block_d, 64))
    grid = (B, triton.cdiv(D, block_d))
    _nk_centre_grad_kernel[grid](
        emb, centres, neighbours, coef, grad,
        K, D,
        emb.stride(0), centres.stride(0), neighbours.stride(0), coef.stride(0), grad.stride(0),
        COMPUTE=_tl_dtype(cdt), BLOCK_K=block_k, BLOCK_D=block_d,
    )
    return grad
