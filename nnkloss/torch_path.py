"""The eager PyTorch implementation of the fused op, chunked over rows.

It returns exactly what the Triton kernel returns (see ``nnkloss.kernels.neighbour_kernel``),
so one autograd definition serves both. Gathered centres are processed ``rows_per_chunk`` rows at
a time, so the largest temporary is (rows_per_chunk, K, D), never (B, K, D).
"""
from __future__ import annotations

import torch

# Upper bound on elements of one gathered (rows, K, D) chunk: 2**22 fp32 = 16 MiB.
CHUNK_ELEMS = 1 << 22


def _rows_per_chunk(K: int, D: int) -> int:
    return max(1, CHUNK_ELEMS // max(1, K * D))


def compute_dtype(emb: torch.Tensor) -> torch.dtype:
    """fp64 in, fp64 math; every other dtype accumulates in fp32."""
    return torch.float64 if emb.dtype == torch.float64 else torch.float32


def _masked_logits(nbr, centre_labels, weights, labels, dist, sigma):
    """Logits of the valid entries (-inf elsewhere) and the same-class mask."""
    valid = nbr >= 0
    safe = nbr.clamp_min(0).long()
    logits = -dist * (0.5 / (sigma * sigma))
    if weights is not None:
        w = weights[safe].to(dist.dtype)
        valid = valid & (w > 0)
        logits = logits + torch.log(torch.where(valid, w, torch.ones_like(w)))
    logits = logits.masked_fill(~valid, float("-inf"))
    same = valid & (centre_labels[safe] == labels[:, None])
    return logits, same


def forward(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    """Same contract as :func:`nnkloss.kernels.neighbour_kernel_fwd`."""
    B, D = emb.shape
    K = neighbours.shape[1]
    cdt = compute_dtype(emb)
    sigma = sigma.to(cdt)
    loss = emb.new_empty(B, dtype=cdt)
    lse_all = emb.new_empty(B, dtype=cdt)
    lse_pos = emb.new_empty(B, dtype=cdt)
    grad_x = emb.new_empty(B, D, dtype=cdt)
    dist = emb.new_empty(B, K, dtype=cdt)
    step = _rows_per_chunk(K, D)
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        nbr = neighbours[lo:hi]
        x = emb[lo:hi].to(cdt)
        diff = centres[nbr.clamp_min(0).long()].to(cdt) - x[:, None, :]  # (rows, K, D), bounded
        d = (diff * diff).sum(-1).masked_fill(nbr < 0, 0.0)  # padding: 0, as the kernel
        logits, same = _masked_logits(nbr, centre_labels, weights, labels[lo:hi], d, sigma)
        la = torch.logsumexp(logits, dim=1)
        lp = torch.logsumexp(logits.masked_fill(~same, float("-inf")), dim=1)
        has_pos = torch.isfinite(lp)
        # exp(-inf - finite) = 0; rows without a positive get zero coefficients.
        p_all = torch.exp(logits - torch.where(torch.isfinite(la), la, 0.0)[:, None])
        # Mask before exp: a close negative minus S_R can overflow, and inf * 0 is nan.
        p_pos = torch.exp(logits.masked_fill(~same, float("-inf"))
                          - torch.where(has_pos, lp, 0.0)[:, None])
        coef = (p_all - p_pos) * has_pos[:, None] / (sigma * sigma)
        grad_x[lo:hi] = torch.einsum("rk,rkd->rd", coef, diff)
        dist[lo:hi] = d
        lse_all[lo:hi] = la
        lse_pos[lo:hi] = lp
        loss[lo:hi] = torch.where(has_pos, la - lp, torch.zeros_like(la))
    return loss, lse_all, lse_pos, grad_x, dist


def centre_grad(emb, centres, neighbours, coef):
    """Same contract as :func:`nnkloss.kernels.centre_grad`."""
    B, D = emb.shape
    K = neighbours.shape[1]
    cdt = compute_dtype(emb)
    grad = emb.new_zeros(centres.shape[0], D, dtype=cdt)
    step = _rows_per_chunk(K, D)
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        nbr = neighbours[lo:hi]
        c = coef[lo:hi].to(cdt) * (nbr >= 0)
        safe = nbr.clamp_min(0).long()
        contrib = c[:, :, None] * (emb[lo:hi].to(cdt)[:, None, :] - centres[safe].to(cdt))
        grad.index_add_(0, safe.reshape(-1), contrib.reshape(-1, D))
    return grad
