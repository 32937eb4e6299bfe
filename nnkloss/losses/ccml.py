"""Class-conditional training objective (CCML, Eq. 15 with Eq. 11), on the gathered neighbour lists.

For a row x with label R and neighbour list N (the same lists as the Eq. 3 loss), let

    m_pos = mean of ||x - c_j||^2 over the k nearest entries of N with y_j = R
    m_neg = mean of ||x - c_j||^2 over the k nearest entries of N with y_j != R
    p     = exp(-s m_pos) / (exp(-s m_pos) + exp(-s m_neg)) = sigmoid(s (m_neg - m_pos))

with ``s = 1/(2 sigma^2)`` (the default ``sigma = 1/sqrt(2)`` gives s = 1, Eq. 15 as printed).
The paper maximises the expected accuracy ``sum_i p_i`` (Eq. 11 with Eq. 15 in place of
Eq. 10): ``objective="accuracy"`` minimises ``1 - p``. ``objective="nll"`` minimises
``-log p = softplus(s (m_pos - m_neg))``, the form of the Eq. 3 loss.

Rows with fewer than k entries on a side average those they have; a row with none on either
side gets loss 0, no gradient, and is left out of the mean. A row with a non-finite distance to
an entry gets a NaN loss and is counted (ops/CONTRACT.md rule 6). Padding (-1) and centres of
weight 0 are not entries. No gradient flows through the choice of entries; gradients reach
``emb`` and ``centres`` (when it requires grad). The distances come from the Eq. 3 op's fused
forward; no (B, K, D) or (B, k, D) tensor is made.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..ops.backends import backend, resolve_backend
from ..ops.neighbour_kernel import reduce_rows
from ..ops.reference import compute_dtype, rows_per_chunk
from ..validation import (REDUCTIONS, as_index, check_inputs, check_sigma, check_values,
                          require_positive_int)
from .base import BankLoss

__all__ = ["class_conditional_loss", "class_conditional_loss_rows", "ClassConditionalLoss",
           "OBJECTIVES"]

OBJECTIVES = ("accuracy", "nll")


@torch.no_grad()
def _list_distances(emb, labels, centres, centre_labels, neighbours, weights) -> Tensor:
    """(B, K) ``||x_b - c_j||^2`` of every list entry (0 for padding) in the compute dtype: the
    Eq. 3 op's ``dist`` output (ops/CONTRACT.md rule 7), through its custom op."""
    one = torch.ones((), dtype=torch.float32, device=emb.device)
    out = torch.ops.nnkloss.nk_forward(
        emb.detach().contiguous(), labels.contiguous(), centres.detach().contiguous(),
        centre_labels.contiguous(), neighbours.contiguous(),
        None if weights is None else weights.detach().contiguous(), one,
        resolve_backend("auto", emb.device), True, False, False)
    return out[4]


@torch.no_grad()
def _select(emb, labels, centres, centre_labels, neighbours, weights, k: int
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The k nearest same-class and other-class entries of each row, nearest first:
    ``(pos, pos_dist, neg, neg_dist, bad)``, (B, min(k, K)) indices (-1 = none) and distances
    (0 for none); ``bad`` (B,) marks rows with a non-finite distance, which cannot be ranked."""
    B, D = emb.shape
    K = neighbours.shape[1]
    kk = min(k, K)
    cdt = compute_dtype(emb)
    out = [torch.full((B, kk), -1, dtype=torch.long, device=emb.device),
           torch.zeros((B, kk), dtype=cdt, device=emb.device),
           torch.full((B, kk), -1, dtype=torch.long, device=emb.device),
           torch.zeros((B, kk), dtype=cdt, device=emb.device),
           torch.zeros(B, dtype=torch.bool, device=emb.device)]
    if B == 0:
        return tuple(out)
    dist = _list_distances(emb, labels, centres, centre_labels, neighbours, weights)
    step = rows_per_chunk(K, 1)  # (rows, K) masks and top-k, never a D axis
    for lo in range(0, B, step):
        nbr = neighbours[lo:lo + step].long()
        safe = nbr.clamp_min(0)
        d = dist[lo:lo + step]
        valid = nbr >= 0
        out[4][lo:lo + step] = (~torch.isfinite(d) & valid).any(1)
        if weights is not None:
            valid = valid & (weights[safe] > 0)
        same = centre_labels[safe] == labels[lo:lo + step, None]
        for sel, sel_d, mask in ((out[0], out[1], valid & same), (out[2], out[3], valid & ~same)):
            dm = d.masked_fill(~mask, math.inf)
            top_d, top_j = dm.topk(kk, dim=1, largest=False)
            none = torch.isinf(top_d)  # fewer than kk entries on this side
            sel[lo:lo + step] = nbr.gather(1, top_j).masked_fill(none, -1)
            sel_d[lo:lo + step] = top_d.masked_fill(none, 0)
    return tuple(out)


class _MeanSqDist(torch.autograd.Function):
    """m_b = mean over valid j of ||x_b - c_{sel[b, j]}||^2 (0 without entries), from
    ``sel_dist``. Backward: dm_b/dx_b = 2 (x_b - cbar_b), dm_b/dc_j = -2 (x_b - c_j) / n_b,
    with cbar summed one selected column at a time.
    """

    @staticmethod
    def forward(ctx, emb, centres, sel, sel_dist):
        B, D = emb.shape
        cdt = compute_dtype(emb)
        valid = sel >= 0
        count = valid.sum(1)
        inv_n = 1.0 / count.clamp_min(1).to(cdt)
        m = torch.where(valid, sel_dist.to(cdt), 0).sum(1) * inv_n
        cbar = torch.zeros(B, D, dtype=cdt, device=emb.device)
        c = centres.detach()
        for t in range(sel.shape[1]):  # k <= K columns; no host sync to skip empty ones
            v = valid[:, t]
            rows = c.index_select(0, sel[:, t].clamp_min(0)).to(cdt)
            # masked, not multiplied by 0: the stand-in row 0 may be NaN
            cbar += rows.masked_fill_(~v[:, None], 0) * inv_n[:, None]
        ctx.save_for_backward(emb, centres, sel, cbar, inv_n, count)
        return m

    @staticmethod
    def backward(ctx, g):
        emb, centres, sel, cbar, inv_n, count = ctx.saved_tensors
        cdt = cbar.dtype
        g = torch.where(count > 0, g.to(cdt), torch.zeros((), dtype=cdt, device=g.device))
        x = emb.to(cdt)
        grad_emb = grad_c = None
        if ctx.needs_input_grad[0]:
            grad_emb = (2.0 * g[:, None] * (x - cbar)).to(emb.dtype)
        if ctx.needs_input_grad[1]:
            # dm_b/dc_j = -2 (x_b - c_j) / n_b: the scatter every bank loss shares.
            coef = (-2.0 * g * inv_n)[:, None].expand(sel.shape).contiguous()
            backend = resolve_backend("auto", emb.device)
            grad_c = torch.ops.nnkloss.nk_centre_grad(emb, centres, sel, coef, backend)
            grad_c = grad_c.to(centres.dtype)
        return grad_emb, grad_c, None, None


def class_conditional_loss_rows(emb, labels, centres, centre_labels, neighbours, k: int = 5,
                                sigma=math.sqrt(0.5), weights: Optional[Tensor] = None,
                                objective: str = "accuracy") -> Tuple[Tensor, Tensor]:
    """``(loss (B,), counted (B,) bool)``: per-row CCML loss (0 where not counted) and the
    rows with entries on both sides; arguments as :func:`class_conditional_loss`."""
    check_inputs(emb, labels, centres, centre_labels, neighbours, weights, "none", "torch")
    k = require_positive_int("k", k)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    sigma_t = check_sigma(sigma, emb.device)
    # Not deferred: the selection could leave a non-finite centre out.
    check_values(emb, centres, neighbours, weights, sigma_t,
                 fused=backend("auto", emb.device, emb.dtype))
    labels, centre_labels = as_index(labels), as_index(centre_labels)
    pos, pos_dist, neg, neg_dist, bad = _select(emb, labels, centres, centre_labels,
                                                neighbours, weights, k)
    # A row with a non-finite distance is NaN and counted (ops/CONTRACT.md rule 6).
    counted = ((pos[:, 0] >= 0) & (neg[:, 0] >= 0)) | bad
    m_pos = _MeanSqDist.apply(emb, centres, pos, pos_dist)
    m_neg = _MeanSqDist.apply(emb, centres, neg, neg_dist)
    cdt = m_pos.dtype
    s = 0.5 / sigma_t.to(cdt) ** 2
    z = s * (m_pos - m_neg)  # -log p = softplus(z), 1 - p = sigmoid(z)
    rows = torch.sigmoid(z) if objective == "accuracy" else nn.functional.softplus(z)
    rows = torch.where(bad, torch.full((), math.nan, dtype=cdt, device=rows.device), rows)
    # where() gives rows not counted an exact zero gradient too.
    return torch.where(counted, rows, torch.zeros((), dtype=cdt, device=rows.device)), counted


def class_conditional_loss(emb, labels, centres, centre_labels, neighbours, k: int = 5,
                           sigma=math.sqrt(0.5), weights: Optional[Tensor] = None,
                           objective: str = "accuracy", reduction: str = "mean") -> Tensor:
    """Class-conditional metric learning loss (CCML, Eq. 15) on precomputed neighbour lists.

    Args:
        emb: (B, D) float embeddings (math in fp32, fp64 for fp64 emb).
        labels: (B,) integer labels.
        centres: (N, D) float centres (may require grad).
        centre_labels: (N,) integer labels of the centres.
        neighbours: (B, K) int32/int64 indices into centres, -1 = padding.
        k: same-class and other-class entries averaged per row (Eq. 15's k).
        sigma: the distances are scaled by ``1/(2 sigma^2)``; the default makes that 1.
        weights: optional (N,) non-negative weights; only zeros matter (they remove centres).
        objective: "accuracy" (1 - p, the paper's expected accuracy) or "nll" (-log p).
        reduction: "mean" (over rows that have both same- and other-class entries), "sum" or
            "none" ((B,), 0 for rows without both).

    Returns:
        The loss in the compute dtype (0-dim, or (B,) for "none").
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    rows, counted = class_conditional_loss_rows(emb, labels, centres, centre_labels,
                                                neighbours, k, sigma, weights, objective)
    return reduce_rows(rows, counted, reduction)


class ClassConditionalLoss(BankLoss):
    """CCML loss on a :class:`CentreBank`: ``loss = ClassConditionalLoss(bank, k)(emb, labels, idx)``.

    Args:
        bank: the CentreBank whose neighbour lists and centres are used.
        k: entries per side (see :func:`class_conditional_loss`).
        sigma, objective, reduction: as in :func:`class_conditional_loss`.
        learn_sigma: learn sigma (as ``log_sigma``; see :meth:`kernel_sigma`).
        exclude_self: drop each example's own centre from its list.

    ``forward(emb, labels, idx)``, idx the batch's bank rows. ``last_valid``: the rows the last
    call counted.
    """

    def __init__(self, bank: CentreBank, k: int = 5, sigma: float = math.sqrt(0.5),
                 objective: str = "accuracy", reduction: str = "mean",
                 exclude_self: bool = True, learn_sigma: bool = False):
        super().__init__(bank, reduction, exclude_self)
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self._init_sigma(sigma, learn_sigma)
        self.k = require_positive_int("k", k)
        self.objective = objective

    def rows(self, emb: Tensor, labels: Tensor, neighbours: Tensor) -> Tuple[Tensor, Tensor]:
        return class_conditional_loss_rows(emb, labels, self.bank.centres, self.bank.centre_labels,
                                           neighbours, self.k, self.sigma_tensor(),
                                           self.bank.weights_for_loss(), self.objective)

    @property
    def last_valid(self) -> Optional[Tensor]:
        return None if self.last_stats is None else self.last_stats.counted

    def extra_repr(self) -> str:
        return (f"k={self.k}, sigma={self.kernel_sigma():.4g}, objective={self.objective!r}, "
                f"reduction={self.reduction!r}, exclude_self={self.exclude_self}")
