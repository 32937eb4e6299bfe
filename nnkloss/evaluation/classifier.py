"""NeighbourKernelClassifier: Eq. 3 of Meyer et al. at inference (the k nearest centres vote
with their weighted kernel values), or the CCKNN rule (CCML Eq. 14: the class nearest in summed
distance to its own k nearest centres). Both normalise relative to each query's nearest centre:
never NaN."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..bank.centre_bank import CentreBank
from ..bank.centroids import as_tensor
from ..validation import (all_finite, plain_eager, require_float, require_int,
                          require_positive_int, require_sigma)
from ..bank.search import knn
from ..ops.backends import fused_pass
from ..bank.search.knn import check_search_backend

__all__ = ["NeighbourKernelClassifier", "RULES"]

RULES = ("nngk", "ccknn")

# Largest gathered (rows, k, D) block of the torch form (where no fused pass runs).
_GATHER_ELEMS = 1 << 22


def _fused_rel_sqdist(x: Tensor, centres: Tensor, idx: Tensor, ref: Tensor,
                      cdt: torch.dtype) -> Optional[Tensor]:
    """:func:`_sq_dist_minus_ref` in one fused pass of the device's backend, or None."""
    impl = fused_pass(x.device)
    return None if impl is None else impl.rel_sqdist(x, centres, idx, ref, cdt)


def _sq_dist_minus_ref(x: Tensor, centres: Tensor, idx: Tensor, ref: Tensor,
                      cdt: torch.dtype) -> Tensor:
    """(Q, k) ``||x_q - c_j||^2 - ||x_q - c_r||^2`` for j = idx[q, :], r = ref[q], in ``cdt``,
    as ``(c_j - c_r) . (c_j + c_r - 2 x_q)``, precise however far the query; fused where a
    backend runs, else torch in blocks of ``_GATHER_ELEMS``."""
    out = _fused_rel_sqdist(x, centres, idx, ref, cdt) if plain_eager(x, centres, idx, ref) \
        else None
    return out if out is not None else _torch_rel_sqdist(x, centres, idx, ref, cdt)


def _torch_rel_sqdist(x: Tensor, centres: Tensor, idx: Tensor, ref: Tensor,
                      cdt: torch.dtype) -> Tensor:
    q, k = idx.shape
    d = x.shape[1]
    out = torch.empty(q, k, dtype=cdt, device=x.device)
    step = max(1, _GATHER_ELEMS // max(1, (k + 1) * d))
    for lo in range(0, q, step):
        c = centres[idx[lo:lo + step]].to(cdt)              # (rows, k, D)
        r = centres[ref[lo:lo + step]].to(cdt)[:, None, :]  # (rows, 1, D)
        two_x = 2.0 * x[lo:lo + step, None, :].to(cdt)
        out[lo:lo + step] = ((c - r) * (c + r - two_x)).sum(-1)
    return out


def _check_k(k: int, available: int, which: str = "") -> None:
    """ValueError naming k where it exceeds the bank's ``available`` centres."""
    if k > available:
        raise ValueError(f"k={k} is larger than the bank's {available} centres{which}")


class NeighbourKernelClassifier(nn.Module):
    """Classify embeddings with a :class:`CentreBank` (training features, class means, ...).

    Args:
        bank: the CentreBank, read as it is at call time.
        k: neighbours per query, at most the bank's centres of weight > 0 (ValueError naming
            k); ``bank.num_centres`` uses all (with class means and sigma = 1: NCM). For
            "ccknn", neighbours from *each* class (fewer where a class has fewer).
        sigma: kernel width (> 0).
        search_backend: "auto", "torch" or "faiss" (see :func:`nnkloss.knn`).
        batch_size: query rows per search call.
        rule: "nngk" (Eq. 3, default) or "ccknn" (CCML Eq. 14).

    Centres of weight 0 are left out ("ccknn" uses no other weight). Methods take emb (B, D)
    float (tensor or numpy), without autograd; probabilities are fp32 (fp64 for fp64 emb) over
    C = ``bank.num_classes`` columns.
    """

    def __init__(self, bank: CentreBank, k: int, sigma: float, search_backend: str = "auto",
                 batch_size: int = 8192, rule: str = "nngk"):
        super().__init__()
        if not isinstance(bank, CentreBank):
            raise TypeError(f"bank must be a CentreBank, got {type(bank).__name__}")
        self.k = require_positive_int("k", k)
        self.sigma = require_sigma(sigma)  # raises on <= 0, inf, NaN, non-numbers
        self.search_backend = check_search_backend(search_backend)
        self.batch_size = require_positive_int("batch_size", batch_size)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        _check_k(self.k, bank.num_centres)
        self.bank = bank
        self.rule = rule

    @torch.no_grad()
    def predict_proba(self, emb, neighbours: Optional[Tensor] = None) -> Tensor:
        """(B, C) class probabilities of the rows of ``emb`` (B, D). ``neighbours``: optional
        (B, K >= k) bank rows of each query's nearest centres, nearest first, of a search
        already made (the first k are used; ``rule="nngk"`` only)."""
        x = self._check_emb(emb)
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        if neighbours is not None:  # rule "nngk" only
            neighbours = self._check_neighbours(neighbours, x.shape[0])
        scores = (self._log_scores_ccknn(x, cdt) if self.rule == "ccknn"
                  else self._log_scores_nngk(x, cdt, neighbours))
        return torch.softmax(scores, dim=1)

    @torch.no_grad()
    def predict(self, emb, neighbours: Optional[Tensor] = None) -> Tensor:
        """(B,) int64 predicted classes; arguments as :meth:`predict_proba`."""
        return self.predict_proba(emb, neighbours).argmax(dim=1)

    def forward(self, emb, neighbours: Optional[Tensor] = None) -> Tensor:
        return self.predict_proba(emb, neighbours)

    def _check_emb(self, emb) -> Tensor:
        emb = as_tensor("emb", emb)
        require_float("emb", emb, 2)
        bank = self.bank
        if bank.num_centres == 0:
            raise RuntimeError("the bank is empty: add centres before classifying")
        lowest = int(bank.centre_labels.min())
        if lowest < 0:
            raise ValueError(f"the bank's centre_labels must be >= 0 to classify with (column "
                             f"c of the probabilities is class c), got {lowest}")
        _check_k(self.k, bank.num_centres)
        if emb.shape[1] != bank.dim:
            raise ValueError(f"emb has dimension {emb.shape[1]} but the bank's centres have "
                             f"dimension {bank.dim}")
        emb = emb.detach().to(bank.centres.device)
        if not all_finite(emb):
            raise ValueError("emb contains NaN or inf")
        return emb

    def _check_neighbours(self, neighbours, b: int) -> Tensor:
        if self.rule != "nngk":
            raise ValueError(f"neighbours can only be given with rule='nngk' (rule={self.rule!r} "
                             f"searches each class's centres separately)")
        neighbours = as_tensor("neighbours", neighbours)
        require_int("neighbours", neighbours, 2)
        n, k = self.bank.num_centres, self.k
        if neighbours.shape[0] != b or neighbours.shape[1] < k:
            raise ValueError(f"neighbours must have shape (B={b}, K >= {k}), got "
                             f"{tuple(neighbours.shape)}")
        neighbours = neighbours[:, :k].to(self.bank.centres.device).long()
        if neighbours.numel() and (int(neighbours.min()) < 0 or int(neighbours.max()) >= n):
            raise ValueError(f"neighbours must be bank rows in [0, {n}), got values in "
                             f"[{int(neighbours.min())}, {int(neighbours.max())}]")
        usable = torch.isfinite(self.bank.log_weights.detach())[neighbours].any(dim=1)
        if not bool(usable.all()):
            bad = int((~usable).nonzero()[0, 0])
            raise ValueError(f"every neighbour of query row {bad} has weight 0: nothing to "
                             f"classify it with")
        return neighbours

    def _usable(self):
        """(centres, centre_labels, log_weights) of the centres with weight > 0."""
        bank = self.bank
        log_w = bank.log_weights.detach()
        keep = torch.isfinite(log_w)  # log(0) = -inf: a removed centre
        if bool(keep.all()):
            return bank.centres, bank.centre_labels, log_w
        if not bool(keep.any()):
            raise RuntimeError("every centre of the bank has weight 0: nothing to classify with")
        _check_k(self.k, int(keep.sum()), " of weight > 0")
        return bank.centres[keep], bank.centre_labels[keep], log_w[keep]

    def _log_scores_nngk(self, x: Tensor, cdt, neighbours: Optional[Tensor] = None) -> Tensor:
        """(B, C) log of the unnormalised Eq. 3 class sums (``neighbours``: checked bank rows)."""
        bank = self.bank
        centres, centre_labels, log_w = (self._usable() if neighbours is None else (
            bank.centres, bank.centre_labels, bank.log_weights.detach()))
        num_classes = bank.num_classes
        inv = 0.5 / (self.sigma * self.sigma)
        out = torch.full((x.shape[0], num_classes), float("-inf"), dtype=cdt, device=x.device)
        for lo in range(0, x.shape[0], self.batch_size):
            xb = x[lo:lo + self.batch_size]
            if neighbours is None:
                idx = knn(xb, centres, self.k, search_backend=self.search_backend).neighbours
            else:
                idx = neighbours[lo:lo + self.batch_size]
            # Distances relative to the nearest centre: the shift cancels in the ratio.
            rel = _sq_dist_minus_ref(xb, centres, idx, idx[:, 0], cdt)
            logits = log_w[idx].to(cdt) - rel * inv
            m = logits.max(dim=1, keepdim=True).values  # finite: every weight here is > 0
            sums = torch.zeros(xb.shape[0], num_classes, dtype=cdt, device=x.device)
            sums.scatter_add_(1, centre_labels[idx], torch.exp(logits - m))
            out[lo:lo + self.batch_size] = torch.log(sums) + m  # log 0 = -inf for absent classes
        return out

    def _log_scores_ccknn(self, x: Tensor, cdt) -> Tensor:
        """(B, C) scores ``-(1/k) sum_{j<=k} ||x - NN^C_j(x)||^2 / (2 sigma^2)`` up to a per-row
        constant: softmax CCML Eq. 10, argmax Eq. 14."""
        centres, centre_labels, _ = self._usable()
        num_classes = self.bank.num_classes
        inv = 0.5 / (self.sigma * self.sigma)
        out = torch.full((x.shape[0], num_classes), float("-inf"), dtype=cdt, device=x.device)
        if x.shape[0] == 0:  # no query: (0, C), as the NNGK rule gives (the cat below needs one)
            return out
        classes, inverse, counts = torch.unique(centre_labels, return_inverse=True,
                                                return_counts=True)
        order = torch.argsort(inverse, stable=True)  # centre rows grouped by class
        # One reference centre per query, shared by all classes: it cancels in the softmax.
        ref = torch.cat([knn(x[lo:lo + self.batch_size], centres, 1,
                             search_backend=self.search_backend).neighbours
                         for lo in range(0, x.shape[0], self.batch_size)])[:, 0]
        for c, members in zip(classes.tolist(), order.split(counts.tolist())):
            base = centres[members]
            kc = min(self.k, len(members))
            for lo in range(0, x.shape[0], self.batch_size):
                xb = x[lo:lo + self.batch_size]
                idx = knn(xb, base, kc, search_backend=self.search_backend).neighbours
                rel = _sq_dist_minus_ref(xb, centres, members[idx], ref[lo:lo + self.batch_size],
                                         cdt)
                out[lo:lo + self.batch_size, c] = -rel.mean(dim=1) * inv
        return out

    def extra_repr(self) -> str:
        return (f"k={self.k}, sigma={self.sigma:.4g}, rule={self.rule!r}, "
                f"search_backend={self.search_backend!r}, batch_size={self.batch_size}")
