"""The tests' one fp64 reference of the op, one row at a time, independent of nnkloss.

Written from docs/MATHS.md (sections 2-6) and nnkloss/ops/CONTRACT.md. One per-row computation
(:func:`_row`) and three views of it:

- :func:`forward`: the five outputs every backend's forward returns (the contract), plus a
  per-row magnitude of the embedding gradient's terms for tolerances;
- :func:`gradients`: the loss rows and the four gradients of their sum from the closed forms of
  docs/MATHS.md section 3, with per-row shifts, so they stay exact where autograd through a
  log-sum-exp would not; plus the magnitudes of their terms;
- :func:`reference_loss_rows` / :func:`reference_loss`: the loss as a differentiable torch
  expression, for autograd, ``gradcheck`` and finite differences.

Values are those the op computes with: embeddings in the op's compute dtype (fp64 for fp64
embeddings, else fp32, which holds bf16 / fp16 exactly), weights and sigma likewise, the bank as
stored; then everything is fp64. A scaled distance beyond the compute dtype's range is inf
(fp32 overflow). Both log-sum-exps take their own maximum and probabilities are normalised by
the computed sums, as docs/MATHS.md section 4 requires of the op.
"""
import decimal
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["Forward", "Gradients", "forward", "gradients", "reference_loss_rows",
           "reference_loss", "compute_dtype"]


def compute_dtype(emb: Tensor) -> torch.dtype:
    return torch.float64 if emb.dtype == torch.float64 else torch.float32


class _Row(NamedTuple):
    """One row's terms over its non-padding entries (n of them, in list order)."""
    js: list             # bank rows of the entries
    diff: Tensor         # (n, D) c_j - x
    u: Tensor            # (n,) scaled squared distances
    valid: Tensor        # (n,) bool, weight != 0
    same: Tensor         # (n,) bool, valid and of the row's class
    bad: bool            # touched by a non-finite value
    logits: Tensor       # (n,) log w - u / 2 (valid entries only meaningful)
    lse_all: Tensor      # 0-dim, -inf without valid entries
    lse_pos: Tensor      # 0-dim, -inf without same-class entries
    p: Tensor            # (n,) detached probabilities of the whole sum, 0 where not valid
    pr: Tensor           # (n,) detached probabilities of the same-class sum


def _lse_and_p(logits: Tensor, mask: Tensor):
    """Log-sum-exp over ``mask`` with its own (detached) maximum, and the probabilities
    normalised by the computed sum (never exp(l - lse))."""
    if not bool(mask.any()):
        return logits.new_tensor(-math.inf), torch.zeros_like(logits.detach())
    sel = logits[mask]
    m = sel.detach().max()
    e = torch.exp(sel - m)
    s = e.sum()
    p = torch.zeros_like(logits.detach())
    p[mask] = (e / s).detach()
    return m + torch.log(s), p


def _row(x: Tensor, label: int, centres: Tensor, centre_labels, weights: Optional[Tensor],
         nbr: list, s: Tensor, cdt: torch.dtype) -> _Row:
    js = [j for j in nbr if j >= 0]
    idx = torch.tensor(js, dtype=torch.long)
    diff = centres[idx] - x                                  # (n, D)
    z = diff * (1.0 / s)                                     # scale before squaring
    u = (z * z).sum(1)
    if cdt == torch.float32:                                 # beyond fp32: inf, as in the op
        u = torch.where(u > torch.finfo(torch.float32).max, math.inf, u)
    if weights is None:
        w = torch.ones(len(js), dtype=torch.float64)
    else:
        w = weights[idx]
    valid = (w != 0).detach()
    logw = torch.log(torch.where(valid, w, torch.ones_like(w)))
    bad = bool((~torch.isfinite(u.detach())).any() or (~torch.isfinite(logw.detach()[valid])).any())
    same = valid & torch.tensor([int(centre_labels[j]) == label for j in js], dtype=torch.bool)
    logits = logw - u / 2
    lse_all, p = _lse_and_p(logits, valid)
    lse_pos, pr = _lse_and_p(logits, same)
    return _Row(js, diff, u, valid, same, bad, logits, lse_all, lse_pos, p, pr)


def _inputs(emb, centres, weights, sigma):
    """fp64 copies of what the op computes with (see the module docstring); differentiable."""
    cdt = compute_dtype(emb)
    x = emb.to(cdt).double()
    c = centres.double()
    w = None if weights is None else weights.to(cdt).double()
    s = sigma if isinstance(sigma, Tensor) else torch.tensor(float(sigma), dtype=torch.float64)
    s = s.to(cdt).double()
    return cdt, x, c, w, s


# ----------------------------------------------------------------------------- forward
class Forward(NamedTuple):
    """The contract's five outputs in fp64, and ``grad_scale`` (B,): the sum of the magnitudes
    of grad_x's terms, ``sum_j (p_j + p^R_j) max|c_j - x| / sigma^2``, for tolerances."""
    loss: Tensor
    lse_all: Tensor
    lse_pos: Tensor
    grad_x: Tensor
    dist: Tensor
    grad_scale: Tensor


@torch.no_grad()
def forward(emb, labels, centres, centre_labels, neighbours, weights, sigma) -> Forward:
    """nnkloss/ops/CONTRACT.md: loss, lse_all, lse_pos (B,), grad_x (B, D), dist (B, K) of the
    scaled squared distances (0 for padding), in fp64."""
    cdt, x, c, w, s = _inputs(emb, centres, weights, sigma)
    B, D = x.shape
    K = neighbours.shape[1]
    loss = torch.zeros(B, dtype=torch.float64)
    lse_all = torch.full((B,), -math.inf, dtype=torch.float64)
    lse_pos = torch.full((B,), -math.inf, dtype=torch.float64)
    grad_x = torch.zeros(B, D, dtype=torch.float64)
    dist = torch.zeros(B, K, dtype=torch.float64)
    scale = torch.zeros(B, dtype=torch.float64)
    for b in range(B):
        nbr = [int(j) for j in neighbours[b].tolist()]
        r = _row(x[b], int(labels[b]), c, centre_labels, w, nbr, s, cdt)
        dist[b, [k for k, j in enumerate(nbr) if j >= 0]] = r.u
        if r.bad:
            loss[b] = lse_all[b] = lse_pos[b] = math.nan
            grad_x[b] = math.nan
            continue
        lse_all[b], lse_pos[b] = r.lse_all, r.lse_pos
        if not bool(r.same.any()):
            continue
        loss[b] = r.lse_all - r.lse_pos
        grad_x[b] = ((r.p - r.pr)[:, None] * r.diff).sum(0) / (s * s)
        scale[b] = ((r.p + r.pr) * r.diff.abs().amax(1)).sum() / (s * s)
    return Forward(loss, lse_all, lse_pos, grad_x, dist, scale)


# ----------------------------------------------------------------------------- gradients
class Gradients(NamedTuple):
    """``rows`` (B,) fp64 losses (0 without a positive, NaN where non-finite); ``counted`` (B,)
    bool; ``grads`` and ``magnitudes``: dicts "emb", "centres", "weights", "sigma" -> the
    gradient of ``rows.sum()``, and the same sums with |p_j| + |p^R_j| in place of
    p_j - p^R_j (a gradient that cancels to ~0 can be off by eps times that, at best)."""
    rows: Tensor
    counted: Tensor
    grads: dict
    magnitudes: dict


@torch.no_grad()
def gradients(emb, labels, centres, centre_labels, neighbours, weights, sigma) -> Gradients:
    """The loss rows and the closed-form gradients of docs/MATHS.md section 3 (weights None:
    all ones, and the weight gradient is that of all-ones weights)."""
    cdt, x, c, w, s = _inputs(emb, centres, weights, sigma)
    if w is None:
        w = torch.ones(c.shape[0], dtype=torch.float64)
    B = x.shape[0]
    rows = torch.zeros(B, dtype=torch.float64)
    counted = torch.zeros(B, dtype=torch.bool)
    g = {"emb": torch.zeros_like(x), "centres": torch.zeros_like(c),
         "weights": torch.zeros_like(w), "sigma": torch.zeros((), dtype=torch.float64)}
    m = {name: torch.zeros_like(t) for name, t in g.items()}
    for b in range(B):
        r = _row(x[b], int(labels[b]), c, centre_labels, w, neighbours[b].tolist(), s, cdt)
        idx = torch.tensor(r.js, dtype=torch.long)
        if r.bad:
            rows[b], counted[b] = math.nan, True
            g["emb"][b] = math.nan
            g["centres"][idx] = math.nan
            g["weights"][idx] = math.nan
            g["sigma"] = g["sigma"] + math.nan
            continue
        if not bool(r.same.any()):
            continue  # no positive: loss 0, no gradient, not counted
        rows[b], counted[b] = r.lse_all - r.lse_pos, True
        v = r.valid
        dl, am = r.p - r.pr, r.p + r.pr
        g["emb"][b] = (dl[:, None] * r.diff).sum(0) / (s * s)
        m["emb"][b] = (am[:, None] * r.diff.abs()).sum(0) / (s * s)
        g["centres"].index_add_(0, idx, -dl[:, None] * r.diff / (s * s))
        m["centres"].index_add_(0, idx, am[:, None] * r.diff.abs() / (s * s))
        wv = torch.where(v, w[idx], torch.ones_like(w[idx]))
        g["weights"].index_add_(0, idx[v], (dl / wv)[v])
        m["weights"].index_add_(0, idx[v], (am / wv)[v])
        shifted = r.u - r.u[v].min()  # per-row shift: sum_j (p_j - p^R_j) = 0
        g["sigma"] += (dl * shifted)[v].sum() / s
        m["sigma"] += (am * shifted)[v].sum() / s
        if bool((~v).any()):
            # A zero weight: the one-sided derivative exp(-u_j/2 - S) - [same] exp(-u_j/2 - S_R),
            # in decimal arithmetic: each term may exceed fp64's range while their difference
            # does not (a far same-class centre: both sums hold the same entries, difference 0).
            la, lp = float(r.lse_all), float(r.lse_pos)
            same_class = [int(centre_labels[j]) == int(labels[b]) for j in r.js]
            with decimal.localcontext(decimal.Context(prec=60)):
                at_zero = [float(decimal.Decimal(-uj / 2 - la).exp()
                                 - int(sc) * decimal.Decimal(-uj / 2 - lp).exp())
                           for uj, sc, keep in zip(r.u.tolist(), same_class, v.tolist(),
                                                   strict=True) if not keep]
            g["weights"].index_add_(0, idx[~v], torch.tensor(at_zero, dtype=torch.float64))
    return Gradients(rows, counted, g, m)


# ----------------------------------------------------------------------------- autograd
def reference_loss_rows(emb, labels, centres, centre_labels, neighbours, weights=None,
                        sigma=1.0):
    """Returns (per-row loss (B,) fp64, counted (B,) bool), differentiable in emb, centres,
    weights and sigma (tensors that require grad); rows without a positive give 0, non-finite
    rows NaN."""
    cdt, x, c, w, s = _inputs(emb, centres, weights, sigma)
    rows, counted = [], []
    for b in range(x.shape[0]):
        r = _row(x[b], int(labels[b]), c, centre_labels, w, neighbours[b].tolist(), s, cdt)
        keep_graph = 0.0 * x[b].sum()  # a zero that still depends on the inputs
        if r.bad:
            rows.append(keep_graph + math.nan)
            counted.append(True)
        elif bool(r.same.any()):
            rows.append(r.lse_all - r.lse_pos)
            counted.append(True)
        else:
            rows.append(keep_graph)
            counted.append(False)
    return torch.stack(rows), torch.tensor(counted, dtype=torch.bool)


def reference_loss(emb, labels, centres, centre_labels, neighbours, weights=None, sigma=1.0,
                   reduction="mean"):
    """The reduced loss: "mean" over counted rows (0 when none is), "sum", or "none" (B,)."""
    rows, counted = reference_loss_rows(emb, labels, centres, centre_labels, neighbours,
                                        weights, sigma)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / max(int(counted.sum()), 1)
