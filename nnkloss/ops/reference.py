"""The plain PyTorch implementation of every pass of the op, chunked over rows: the torch
backend and the fp64 oracle the others are tested against.

Its forward returns exactly what the Triton kernel returns (ops/CONTRACT.md); gathered centres
are processed ``rows_per_chunk`` rows at a time, so the largest temporary is (rows, K, D),
never (B, K, D). Numerics (docs/MATHS.md section 4): distances are scaled before they are
squared; probabilities are normalised by the computed sums, never ``exp(l_j - lse)``; a row
touched by a non-finite value gets NaN loss, lse's and gradient, never "no positive".
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

# Upper bound on elements of one gathered (rows, K, D) chunk: 2**22 fp32 = 16 MiB.
CHUNK_ELEMS = 1 << 22


def rows_per_chunk(K: int, D: int) -> int:
    """Rows of a (rows, K, D) gather that fit in CHUNK_ELEMS elements (at least one)."""
    return max(1, CHUNK_ELEMS // max(1, K * D))


def compute_dtype(emb: Tensor) -> torch.dtype:
    """fp64 in, fp64 math; every other dtype accumulates in fp32."""
    return torch.float64 if emb.dtype == torch.float64 else torch.float32


def empty_outputs(emb: Tensor, K: int, store_dist: bool, need_grad_x: bool = True):
    """The forward's five outputs, uninitialised, in the compute dtype on emb's device:
    loss, lse_all, lse_pos (B,), grad_x (B, D), or (B, 0) without need_grad_x, dist (B, K), or
    (B, 0) without store_dist."""
    B, D = emb.shape
    cdt = compute_dtype(emb)
    return (emb.new_empty(B, dtype=cdt), emb.new_empty(B, dtype=cdt), emb.new_empty(B, dtype=cdt),
            emb.new_empty(B, D if need_grad_x else 0, dtype=cdt),
            emb.new_empty(B, K if store_dist else 0, dtype=cdt))


class RowSoftmax(NamedTuple):
    """Exact per-row softmax pieces of the logits over a mask: sum of exp, probabilities, lse."""
    s: Tensor      # (B, 1) sum of exp(logit - row max), 0 where the row is empty
    p: Tensor      # (B, K) e / s, 0 outside the mask and in empty rows
    lse: Tensor    # (B,) log-sum-exp, -inf where the row is empty


def row_softmax(logits: Tensor, mask: Tensor) -> RowSoftmax:
    masked = logits.masked_fill(~mask, float("-inf"))
    m = masked.amax(dim=1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(masked - m)
    s = e.sum(dim=1, keepdim=True)
    nonempty = s > 0
    p = e / torch.where(nonempty, s, torch.ones_like(s))
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, s, torch.ones_like(s))),
                      torch.full_like(s, float("-inf")))
    return RowSoftmax(s, p, lse.squeeze(1))


class RowTerms(NamedTuple):
    """Per-entry terms of the loss for a block of rows (see :func:`row_terms`)."""
    nonpad: Tensor   # (B, K) entry is not padding
    valid: Tensor    # (B, K) non-padding with non-zero weight
    same_class: Tensor  # (B, K) non-padding and of the row's class (zero weights included)
    w: Optional[Tensor]  # (B, K) gathered weights (None without weights)
    logits: Tensor   # (B, K) log w - u / 2 (meaningful where valid)
    bad: Tensor      # (B,) row touched by a non-finite value
    all: RowSoftmax
    pos: RowSoftmax


def _gather_source(t: Optional[Tensor], fill) -> Optional[Tensor]:
    """Indexable copy of a per-centre tensor: an empty bank gathers one dummy row instead."""
    if t is None or t.shape[0]:
        return t
    return torch.full((1,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)


def row_terms(neighbours: Tensor, u: Tensor, labels: Tensor, centre_labels: Tensor,
              weights: Optional[Tensor]) -> RowTerms:
    """Masks, logits and exact softmaxes of rows with lists ``neighbours`` and scaled distances
    ``u``.

    Used by the forward and, from the saved distances, by the backward: both see the same
    probabilities.
    """
    nonpad = neighbours >= 0
    safe = neighbours.clamp_min(0).long()
    logits = u * -0.5
    bad = (nonpad & ~torch.isfinite(u)).any(dim=1)
    valid = nonpad
    w = None
    if weights is not None:
        w = _gather_source(weights, 1.0)[safe].to(u.dtype)
        valid = nonpad & (w != 0)
        logw = torch.log(torch.where(valid, w, torch.ones_like(w)))
        bad = bad | (valid & ~torch.isfinite(logw)).any(dim=1)
        logits = logits + logw
    same_class = nonpad & (_gather_source(centre_labels, 0)[safe] == labels[:, None])
    same = valid & same_class
    return RowTerms(nonpad, valid, same_class, w, logits, bad,
                    row_softmax(logits, valid), row_softmax(logits, same))


def forward(emb, labels, centres, centre_labels, neighbours, weights, sigma, store_dist=True,
            need_grad_x=True, mean=False):
    """Same contract as :func:`nnkloss.kernels.neighbour_kernel_fwd` (ops/CONTRACT.md);
    without ``need_grad_x`` no gradient term is formed and grad_x is (B, 0); with ``mean``
    also counted (B,) bool and the counted mean and its divisor."""
    B, D = emb.shape
    K = neighbours.shape[1]
    cdt = compute_dtype(emb)
    inv_sigma = 1.0 / sigma.to(cdt)
    loss, lse_all, lse_pos, grad_x, dist = empty_outputs(emb, K, store_dist, need_grad_x)
    src = _gather_source(centres, 0.0)
    step = rows_per_chunk(K, D)
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        nbr = neighbours[lo:hi]
        x = emb[lo:hi].to(cdt)
        # 1. Gather and scale before squaring: z = (c - x) / sigma, u = ||z||^2.
        z = (src[nbr.clamp_min(0).long()].to(cdt) - x[:, None, :]) * inv_sigma  # bounded chunk
        u = (z * z).sum(-1).masked_fill(nbr < 0, 0.0)
        # 2. Exact probabilities of both sums.
        t = row_terms(nbr, u, labels[lo:hi], centre_labels, weights)
        has_pos = t.pos.s.squeeze(1) > 0
        row_loss = torch.where(has_pos, t.all.lse - t.pos.lse, torch.zeros_like(t.all.lse))
        # 3. Non-finite rows: NaN everywhere, never "no positive".
        nan = torch.full_like(row_loss, float("nan"))
        loss[lo:hi] = torch.where(t.bad, nan, row_loss)
        lse_all[lo:hi] = torch.where(t.bad, nan, t.all.lse)
        lse_pos[lo:hi] = torch.where(t.bad, nan, t.pos.lse)
        if need_grad_x:
            # 4. dL/dx = (1/sigma^2) sum (p - p^R)(c - x) = (1/sigma) sum (p - p^R) z.
            coef = (t.all.p - t.pos.p) * (has_pos[:, None] * inv_sigma)
            # Padding gathered row 0 as a stand-in: its coefficient is 0, but 0 times a NaN or
            # inf of that row (a bank slot no list names) would make a finite row's grad_x NaN.
            gx = torch.einsum("rk,rkd->rd", coef, z.masked_fill((nbr < 0)[:, :, None], 0.0))
            grad_x[lo:hi] = torch.where(t.bad[:, None], float("nan"), gx)
        if store_dist:
            dist[lo:hi] = u
    if not mean:
        return loss, lse_all, lse_pos, grad_x, dist
    counted = counted_rows(lse_pos)
    return (loss, lse_all, lse_pos, grad_x, dist, counted) + counted_mean(loss, counted)


def centre_grad(emb, centres, neighbours, coef):
    """Same contract as :func:`nnkloss.kernels.centre_grad`."""
    B, D = emb.shape
    K = neighbours.shape[1]
    cdt = compute_dtype(emb)
    grad = emb.new_zeros(centres.shape[0], D, dtype=cdt)
    if centres.shape[0] == 0:
        return grad
    step = rows_per_chunk(K, D)
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        nbr = neighbours[lo:hi]
        c = coef[lo:hi].to(cdt).masked_fill(nbr < 0, 0.0)
        safe = nbr.clamp_min(0).long()
        contrib = c[:, :, None] * (emb[lo:hi].to(cdt)[:, None, :] - centres[safe].to(cdt))
        # Entries with coef 0 contribute nothing, even where the difference is not finite.
        contrib = torch.where((c != 0)[:, :, None], contrib, 0.0)
        grad.index_add_(0, safe.reshape(-1), contrib.reshape(-1, D))
    return grad


def counted_rows(lse_pos: Tensor) -> Tensor:
    """(B,) bool: the rows a mean counts, those whose lse_pos is not -inf (a same-class entry,
    or NaN: a non-finite row's NaN must reach the mean)."""
    return lse_pos.isneginf().logical_not_()


def counted_mean(per_row: Tensor, counted: Tensor):
    """``(mean, divisor)``: the sum of ``per_row`` over ``divisor = max(count, 1)``."""
    divisor = torch.count_nonzero(counted).clamp_min(1).to(per_row.dtype)
    return per_row.sum() / divisor, divisor


def scale_rows(grad_x: Tensor, g: Tensor, lse_pos: Tensor, out_dtype, divisor=None) -> Tensor:
    """``g[:, None] * grad_x`` (g / divisor with a divisor), 0 in rows where g == 0 or
    lse_pos == -inf: a row that takes no gradient passes none on, even a NaN one."""
    if divisor is not None:
        g = g / divisor
    g = g.to(grad_x.dtype).expand(grad_x.shape[:1])
    takes = (g != 0) & (lse_pos != float("-inf"))
    return torch.where(takes[:, None], g[:, None] * grad_x, 0.0).to(out_dtype)


def entry_grads(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g, sigma,
                need_c: bool, need_w: bool, need_s: bool):
    """The backward's per-entry terms ``(coef, q, srow)`` from the forward's saved distances
    ``u`` (B, K), each None unless asked for (q also without weights): coef = (p - p^R) g /
    sigma^2, the centre gradient's coefficients; q = (p - p^R) g / w, the weight gradient's
    terms; srow (B,), whose sum over rows divided by sigma is sigma's gradient. ``g`` (B,) may
    be an expanded scalar. Rows without a same-class entry or with g == 0 give zeros; a
    non-finite row that takes a gradient gives NaN."""
    cdt = u.dtype
    g = torch.where(lse_pos != float("-inf"), g.to(cdt), torch.zeros((), dtype=cdt,
                                                                      device=u.device))
    takes = (g != 0)[:, None]
    inv_sigma = 1.0 / sigma.to(cdt)
    t = row_terms(neighbours, u, labels, centre_labels, weights)
    bad = torch.isnan(lse_pos)[:, None] & takes
    dl = torch.where(takes, (t.all.p - t.pos.p) * g[:, None], 0.0)  # dLoss/dlogit_j * g
    dl = torch.where(bad, float("nan"), dl)
    coef = q = srow = None
    if need_s:
        # dlogit_j/dsigma = u_j / sigma. sum_j dl_j = 0 in every row, so u_j is shifted by the
        # row's largest logit's before the sum: huge terms no longer cancel. Rows that take no
        # gradient are left out (0 times a non-finite u_j - ref would be NaN).
        ref = u.gather(1, t.logits.masked_fill(~t.valid, float("-inf")).argmax(1, keepdim=True))
        srow = (dl * torch.where(t.valid & takes, u - ref, torch.zeros_like(u))).sum(1)
    if need_c:
        # dlogit_j/dc_j = (x - c_j) / sigma^2 (docs/MATHS.md section 3)
        coef = dl * (inv_sigma * inv_sigma)
    if need_w and weights is not None:
        # dL/dw_j = (p_j - p^R_j) / w_j. For a zero weight (a removed centre) the one-sided
        # derivative exp(-u_j/2 - lse_all) - [same class] exp(-u_j/2 - lse_pos), whose same-class
        # difference is taken in one piece, -exp(-u_j/2 - lse_pos + log(1 - exp(lse_pos -
        # lse_all))), since both terms can overflow where the difference does not.
        nonpad, w = t.nonpad, t.w
        zero = nonpad & (w == 0)
        base = u * -0.5
        la, lp = t.all.lse[:, None], t.pos.lse[:, None]
        at_zero = torch.where(t.same_class,
                              -torch.exp(base - lp + torch.log(-torch.expm1(lp - la))),
                              torch.exp(base - la))
        q = torch.where(zero, at_zero, (t.all.p - t.pos.p) / torch.where(zero, 1.0, w))
        q = torch.where(nonpad, q, 0.0)
        q = torch.where(bad, float("nan"), torch.where(takes, q * g[:, None], 0.0))
        q = torch.where(nonpad, q, 0.0)
    return coef, q, srow
