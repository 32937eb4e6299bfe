"""CentreBank: the device-resident Gaussian kernel centres, their labels, weights and lists."""
from __future__ import annotations

import numbers
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..validation import (all_finite, as_index, compiling, nonnegative_finite, plain_eager,
                          require_float, require_int, require_labelled)
from .centroids import class_centroids
from .search import neighbour_lists

__all__ = ["CentreBank", "validate_bank_tensors"]


def _validate_neighbours(neighbours: Tensor, n: int, name: str = "neighbours") -> Tensor:
    require_int(name, neighbours, 2)
    if neighbours.shape[0] != n:
        raise ValueError(f"{name} must have one row per centre ({n}), got {neighbours.shape[0]}")
    if neighbours.numel():
        lo, hi = int(neighbours.min()), int(neighbours.max())
        if hi >= n:
            raise IndexError(f"{name} holds index {hi} but the bank has only {n} centres")
        if lo < -1:
            raise IndexError(f"{name} holds index {lo}; the only negative index allowed is -1")
    return neighbours


def _validate_weights(weights: Tensor, n: int, positive: bool) -> Tensor:
    require_float("weights", weights, 1)
    if weights.shape[0] != n:
        raise ValueError(f"weights has length {weights.shape[0]} but the bank has {n} centres")
    w = weights.detach()
    if not nonnegative_finite(w):
        raise ValueError("weights must be finite and non-negative")
    w32 = w.float()  # the bank's dtype: a wider weight may overflow or vanish there
    if w32 is not w and not bool(torch.isfinite(w32).all()):
        raise ValueError(f"weights hold a value that overflows torch.float32 (max "
                         f"{w.max().item()}): weights must be finite and non-negative")
    if positive and (w32 <= 0).any():
        raise ValueError("learnable weights must start strictly positive (they are stored as "
                         "log-weights, which keeps them positive while training)")
    return weights


def _check_layout(centres: Tensor) -> None:
    """Refuse centres whose elements share memory (an ``expand()``-ed view: by stride, each
    dimension must step past what the ones before it span); warn that strided centres cost
    every loss call a copy of the bank."""
    span = 0
    for stride, size in sorted((abs(st), s) for s, st in zip(centres.shape, centres.stride())
                               if s > 1):
        if stride <= span:
            raise ValueError(f"centres overlap in memory (strides {tuple(centres.stride())} "
                             f"for shape {tuple(centres.shape)}, e.g. an expand()-ed view): "
                             f"the bank writes its centres in place; pass centres.clone()")
        span += (size - 1) * stride
    if centres.numel() and not centres.is_contiguous():
        warnings.warn(f"centres are not contiguous (strides {tuple(centres.stride())} for shape "
                      f"{tuple(centres.shape)}): every loss call will copy the whole bank to "
                      f"read its rows; pass centres.contiguous() (the bank keeps, and writes "
                      "into, the tensor it is given)", stacklevel=3)


def _index_dtype(n: int) -> torch.dtype:
    """Indices into n rows (and -1): int32 while they fit."""
    return torch.int32 if n < 2 ** 31 else torch.int64


def _compact_labels(labels: Tensor) -> Tensor:
    """int32 labels unless a class id does not fit (checked on the values: one read)."""
    if labels.numel() and (int(labels.max()) >= 2 ** 31 or int(labels.min()) < -2 ** 31):
        return labels.long()
    return labels.to(torch.int32)


def _validate_log_weights(log_w: Tensor, n: int, learned: bool,
                          name: str = "log_weights") -> Tensor:
    """:func:`_validate_weights` on log-weights."""
    require_float(name, log_w, 1)
    if log_w.shape[0] != n:
        raise ValueError(f"{name} has length {log_w.shape[0]} but the bank has {n} centres")
    lw = log_w.detach()
    if torch.isnan(lw).any() or (lw == float("inf")).any():
        raise ValueError(f"{name} contain NaN or +inf: weights must be finite and non-negative")
    if (lw.exp() == float("inf")).any():  # finite, but an infinite weight
        raise ValueError(f"{name} hold a value whose weight exp({name}) overflows {lw.dtype} "
                         f"(max {lw.max().item()}): weights must be finite and non-negative")
    if learned and (lw == float("-inf")).any():
        raise ValueError(f"{name} hold zero weights (-inf), but learned weights must be "
                         "strictly positive")
    return log_w


def _require_finite_cast(given: Tensor, cast: Tensor) -> None:
    """ValueError unless ``cast`` (``given`` in the bank's dtype) is finite, saying whether
    ``given`` held NaN / inf or values the cast made inf."""
    if all_finite(cast):
        return
    if all_finite(given):
        raise ValueError(f"centres hold values beyond the bank's dtype {cast.dtype} (largest "
                         f"{torch.finfo(cast.dtype).max:.6g}): they would be inf in the bank")
    raise ValueError("centres contain NaN or inf")


def validate_bank_tensors(centres: Tensor, centre_labels: Tensor, neighbours: Tensor,
                          log_weights: Tensor, learned: bool, prefix: str = "") -> None:
    """:meth:`CentreBank.update_`'s checks for a whole bank read from disk; errors name the
    field as ``prefix`` + name."""
    require_float(prefix + "centres", centres, 2)
    n = centres.shape[0]
    if not all_finite(centres):
        raise ValueError(f"{prefix}centres contain NaN or inf")
    require_int(prefix + "centre_labels", centre_labels, 1)
    if centre_labels.shape[0] != n:
        raise ValueError(f"{prefix}centre_labels has length {centre_labels.shape[0]} but there "
                         f"are {n} centres")
    _validate_neighbours(neighbours, n, prefix + "neighbours")
    _validate_log_weights(log_weights, n, learned, prefix + "log_weights")


class CentreBank(nn.Module):
    """Kernel centres of a training set, one row per example (or per class centroid).

    Buffers:
        centres: (N, D) fp32/bf16/fp16.
        centre_labels: (N,) int32 (int64 for class ids beyond int32).
        neighbours: (N, K) int32 (int64 from N = 2**31 on), -1 = padding; (N, 0) until set.
    Parameter:
        log_weights: (N,) fp32, ``weights = exp(log_weights)``; requires grad only with
            ``learn_weights=True``.

    State dict version 1 (or none) named ``centre_labels`` ``labels``.
    """

    _version = 2

    def __init__(self, centres: Tensor, centre_labels: Tensor, weights: Optional[Tensor] = None,
                 neighbours: Optional[Tensor] = None, learn_weights: bool = False):
        super().__init__()
        n = require_labelled("centres", centres, "centre_labels", centre_labels,
                             (torch.float16, torch.bfloat16, torch.float32))
        if centre_labels.device != centres.device:
            raise ValueError(f"centre_labels are on {centre_labels.device} but centres on "
                             f"{centres.device}")
        if not all_finite(centres):
            raise ValueError("centres contain NaN or inf")
        _check_layout(centres)
        self.register_buffer("centres", centres.detach())
        self.register_buffer("centre_labels", _compact_labels(centre_labels.detach()))
        neighbours = (torch.empty(n, 0, device=centres.device) if neighbours is None
                      else _validate_neighbours(neighbours, n))
        self.register_buffer("neighbours", neighbours.detach().to(_index_dtype(n)))
        log_w = (torch.zeros(n, dtype=torch.float32, device=centres.device) if weights is None
                 else torch.log(_validate_weights(weights, n, learn_weights).detach().float()))
        self.log_weights = nn.Parameter(log_w, requires_grad=learn_weights)
        self._uniform_weights = weights is None

    @property
    def num_centres(self) -> int:
        return self.centres.shape[0]

    def __len__(self) -> int:
        return self.num_centres

    @property
    def dim(self) -> int:
        return self.centres.shape[1]

    @property
    def k(self) -> int:
        """Length of each neighbour list (0 before any lists are set)."""
        return self.neighbours.shape[1]

    @property
    def has_neighbours(self) -> bool:
        return self.neighbours.shape[1] > 0

    @property
    def learn_weights(self) -> bool:
        return self.log_weights.requires_grad

    @learn_weights.setter
    def learn_weights(self, value: bool) -> None:
        if value:
            if torch.isinf(self.log_weights.detach()).any():
                raise ValueError("cannot learn weights while some are exactly zero")
            self._uniform_weights = False
        self.log_weights.requires_grad_(bool(value))

    @property
    def weights(self) -> Tensor:
        """(N,) non-negative weights (differentiable when learned)."""
        return self.log_weights.exp()

    @property
    def num_classes(self) -> int:
        return int(self.centre_labels.max()) + 1 if self.num_centres else 0

    def weights_for_loss(self) -> Optional[Tensor]:
        """None when all weights are fixed at one (the kernel then skips the weight gather)."""
        log_w = self._parameters["log_weights"]  # read every step: no nn.Module lookup
        if self._uniform_weights and not log_w.requires_grad:
            return None
        return log_w.exp()

    def loss_tensors(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``(centres, centre_labels, neighbours)``, which a loss reads every step, in one call
        (each nn.Module attribute lookup costs a Python fallback)."""
        buffers = self._buffers
        return buffers["centres"], buffers["centre_labels"], buffers["neighbours"]

    @torch.no_grad()
    def update_(self, centres: Optional[Tensor] = None, centre_labels: Optional[Tensor] = None,
                neighbours: Optional[Tensor] = None, weights: Optional[Tensor] = None
                ) -> "CentreBank":
        """Validate the new tensors, then swap them all in at once (nothing changes on error).
        A new N without new lists clears the lists. Tensors move to the bank's device and
        dtype."""
        dev = self.centres.device
        new_c = self.centres
        if centres is not None:
            require_float("centres", centres, 2)  # as given: the cast would hide integers
            new_c = centres.detach().to(dev, self.centres.dtype)
            if new_c.shape[1] != self.dim and self.num_centres:
                raise ValueError(f"centres have dimension {new_c.shape[1]}, bank has {self.dim}")
            _require_finite_cast(centres, new_c)
            _check_layout(new_c)
        n = new_c.shape[0]
        if centre_labels is not None:
            require_int("centre_labels", centre_labels, 1)
        new_l = self.centre_labels if centre_labels is None else centre_labels.detach().to(dev)
        if new_l.shape[0] != n:
            raise ValueError(f"centre_labels has length {new_l.shape[0]} but there are {n} "
                             "centres")
        if neighbours is not None:
            new_nb = _validate_neighbours(neighbours, n).detach().to(dev, _index_dtype(n))
        elif self.neighbours.shape[0] == n:
            new_nb = self.neighbours
        else:
            new_nb = torch.empty(n, 0, dtype=_index_dtype(n), device=dev)
        if weights is not None:
            _validate_weights(weights, n, positive=self.learn_weights)
            new_lw = torch.log(weights.detach().to(dev).float())
        elif self.log_weights.shape[0] == n:
            new_lw = None
        else:
            grow = n - self.log_weights.shape[0]
            if grow < 0:
                raise ValueError("the bank shrank: pass weights for the new set of centres")
            new_lw = torch.cat([self.log_weights.detach(), self.log_weights.new_zeros(grow)])
        self.centres = new_c
        self.centre_labels = _compact_labels(new_l)
        self.neighbours = new_nb
        if new_lw is not None:
            if new_lw.shape == self.log_weights.shape:
                self.log_weights.data.copy_(new_lw)  # keeps optimiser references valid
            else:  # the same Parameter, resized: optimisers keep training it
                self.log_weights.data = new_lw
                self.log_weights.grad = None
            if weights is not None:
                self._uniform_weights = False
        return self

    def set_neighbours(self, neighbours: Tensor) -> "CentreBank":
        """Replace the (N, K) neighbour lists (validated, -1 = padding)."""
        return self.update_(neighbours=neighbours)

    def rebuild_neighbours(self, k: int, search_backend: str = "auto",
                           ensure_positive: bool = False, **knn_options):
        """Recompute and set the (N, k) lists from the current centres, 1 <= k <= N - 1; options
        as in :func:`nnkloss.bank.search.neighbour_lists`. Returns the NeighbourLists set."""
        lists = neighbour_lists(self.centres, self.centre_labels, k,
                                search_backend=search_backend, ensure_positive=ensure_positive,
                                **knn_options)
        self.update_(neighbours=lists.neighbours)
        return lists

    @torch.no_grad()
    def write_centres_(self, idx: Tensor, emb: Tensor, momentum: float = 0.0) -> "CentreBank":
        """In place: ``centres[idx] = momentum * centres[idx] + (1 - momentum) * emb``.

        ``idx`` (B,) int rows on any device; ``emb`` (B, D) float on the bank's device (blended
        in fp32); ``momentum`` in [0, 1). A repeated row takes its last occurrence. No host
        sync: ``idx`` is range-checked on the CPU only, ``emb``'s values not at all.
        """
        require_int("idx", idx, 1)
        idx = as_index(idx)
        require_float("emb", emb, 2)
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
            raise TypeError(f"momentum must be a float in [0, 1), got {type(momentum).__name__}")
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if emb.shape != (idx.shape[0], self.dim):
            raise ValueError(f"emb must have shape ({idx.shape[0]}, {self.dim}) (one row of the "
                             f"bank's dimension per idx), got {tuple(emb.shape)}")
        if emb.device != self.centres.device:
            raise ValueError(f"emb is on {emb.device} but the bank's centres are on "
                             f"{self.centres.device}")
        if idx.device.type == "cpu" and not compiling():
            self.check_rows(idx)
        if idx.numel() == 0:
            return self
        idx = idx.to(self.centres.device)
        # Every occurrence writes its row's last value, so the scatter order does not matter.
        rows, order = torch.sort(idx, stable=True)
        b = rows.shape[0]
        pos = torch.arange(b, device=rows.device)
        is_last = torch.ones(b, dtype=torch.bool, device=rows.device)
        is_last[:-1] = rows[1:] != rows[:-1]
        ends = torch.where(is_last, pos, torch.full_like(pos, b))
        winner = ends.flip(0).cummin(0).values.flip(0)
        new = emb.detach()[order[winner]].float()
        if momentum:
            new = self.centres[rows].float() * momentum + new * (1.0 - momentum)
        self.centres.index_put_((rows,), new.to(self.centres.dtype))
        return self

    def require_neighbours(self) -> None:
        """Raise RuntimeError where the bank has no neighbour lists yet."""
        if not self.has_neighbours:
            raise RuntimeError("the bank has no neighbour lists yet: build them first "
                               "(rebuild_neighbours / set_neighbours / a Refresher)")

    def check_rows(self, idx: Tensor) -> None:
        """IndexError naming ``idx`` where an entry is not a bank row (a sync for CUDA idx)."""
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.num_centres:
                bad = lo if lo < 0 else hi
                raise IndexError(f"idx holds {bad} but the bank has rows 0..{self.num_centres - 1}")

    def neighbours_for(self, idx: Tensor, exclude_self: bool = True) -> Tensor:
        """(B, K) lists of the bank rows ``idx``, with each row's own index replaced by -1."""
        self.require_neighbours()
        require_int("idx", idx, 1)
        idx = as_index(idx)
        if self.neighbours.device.type == "cpu" and plain_eager(idx, self.neighbours):
            from ..cpu import gather_lists  # None: not served, torch below
            nb = gather_lists(self.neighbours, idx, exclude_self)
            if nb is not None:
                return nb
        if idx.device.type == "cpu" and not compiling():
            self.check_rows(idx)
        idx = idx.to(self.neighbours.device)
        nb = self.neighbours[idx]
        if exclude_self:
            nb = nb.masked_fill(nb == idx[:, None], -1)
        return nb

    @classmethod
    def from_class_means(cls, emb, labels, per_class: int = 1, seed: int = 0) -> "CentreBank":
        """A bank of :func:`nnkloss.bank.centroids.class_centroids`, without lists."""
        centres, centre_labels = class_centroids(emb, labels, per_class=per_class, seed=seed)
        return cls(centres, centre_labels)

    @torch.no_grad()
    def add(self, centres: Tensor, centre_labels: Tensor, weights: Optional[Tensor] = None
            ) -> "CentreBank":
        """Append centres (M, D), centre_labels (M,) >= 0 and optional weights (M,) (None: 1)
        in place, validated first. New rows get -1 lists; old rows' log-weights stay bit for
        bit in the same, resized ``log_weights``."""
        m = require_labelled("centres", centres, "centre_labels", centre_labels)
        if self.num_centres and centres.shape[1] != self.dim:
            raise ValueError(f"centres have dimension {centres.shape[1]}, the bank has {self.dim}")
        dev = self.centres.device
        labels = centre_labels.to(dev).long()
        if m and int(labels.min()) < 0:
            raise ValueError(f"centre_labels must be >= 0, got {int(labels.min())}")
        new_lw = None
        if weights is not None:
            require_float("weights", weights, 1)
            if weights.shape[0] != m:
                raise ValueError(f"weights has length {weights.shape[0]} but there are {m} new "
                                 "centres")
            w = weights.detach().to(dev, torch.float32)
            new_lw = torch.log(_validate_weights(w, m, self.learn_weights))
        new_nb = (torch.cat([self.neighbours, self.neighbours.new_full((m, self.k), -1)])
                  if self.has_neighbours else None)
        new_c = centres.detach().to(dev, self.centres.dtype)
        _require_finite_cast(centres, new_c)  # before the concatenation hides which rows
        if self.num_centres:  # an empty bank takes the new centres' dimension
            new_c = torch.cat([self.centres, new_c])
        n_old = self.num_centres
        # update_ pads the new rows' log-weights with 0; given weights then fill them.
        self.update_(centres=new_c, centre_labels=torch.cat([self.centre_labels, labels]),
                     neighbours=new_nb)
        if new_lw is not None and m:
            self.log_weights.data[n_old:] = new_lw
            self._uniform_weights = False
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # The whole bank is validated before anything changes (missing fields as held).
        old_key, new_key = prefix + "labels", prefix + "centre_labels"
        if ((local_metadata.get("version") or 1) < 2 and old_key in state_dict
                and new_key not in state_dict):
            state_dict[new_key] = state_dict.pop(old_key)
        names = ("centres", "centre_labels", "neighbours", "log_weights")
        given = {name: state_dict.get(prefix + name, getattr(self, name)) for name in names}
        if not all(isinstance(t, Tensor) for t in given.values()):
            # PyTorch's own error names the non-tensor.
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                                 missing_keys, unexpected_keys, error_msgs)
        # Checked as they will be stored: the cast to the bank's dtypes can overflow.
        for name in ("centres", "log_weights"):
            if given[name].is_floating_point():
                given[name] = given[name].detach().to(getattr(self, name).dtype)
        validate_bank_tensors(given["centres"], given["centre_labels"], given["neighbours"],
                              given["log_weights"], learned=self.learn_weights, prefix=prefix)
        # Take the saved shapes; labels the width update_ gives them.
        for name in ("centres", "centre_labels", "neighbours"):
            key = prefix + name
            if key in state_dict:
                src = state_dict[key]
                cur = getattr(self, name)
                dtype = _compact_labels(src).dtype if name == "centre_labels" else cur.dtype
                if src.shape != cur.shape or dtype != cur.dtype:
                    setattr(self, name, cur.new_empty(src.shape, dtype=dtype))
        key = prefix + "log_weights"
        if key in state_dict and state_dict[key].shape != self.log_weights.shape:
            self.log_weights.data = self.log_weights.new_empty(state_dict[key].shape)
            self.log_weights.grad = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if key in state_dict:
            self._uniform_weights = bool((self.log_weights.detach() == 0).all())

    def extra_repr(self) -> str:
        return (f"num_centres={self.num_centres}, dim={self.dim}, k={self.k}, "
                f"dtype={self.centres.dtype}, learn_weights={self.learn_weights}")
