"""The neighbour-kernel op: one autograd definition, its custom op, and the functional API.

Forward: one backend call (the contract's outputs, the counted rows, the mean). Backward: one
call for the embedding gradient, plus the per-entry terms and the centre scatter where
centres, weights or sigma take a gradient. The definition (:func:`_forward`,
:func:`_setup_context`, :func:`_backward`) has two carriers: :class:`NeighbourKernelFunction`
for eager calls on plain tensors, the custom op ``nnkloss::nk_forward`` where torch.compile,
export or a dispatch mode must see an opaque call.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import reference
from .backends import backend as resolve, by_name
from ..validation import (as_index, check_gathered_centres_after_op, check_inputs,
                          check_sigma, check_values, plain_eager)

__all__ = ["neighbour_kernel_loss", "neighbour_kernel_loss_with_stats", "LossOutput",
           "loss_rows", "loss_rows_unchecked", "reduce_rows", "NeighbourKernelFunction"]

Outputs = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _forward(emb: Tensor, labels: Tensor, centres: Tensor, centre_labels: Tensor,
             neighbours: Tensor, weights: Optional[Tensor], sigma: Tensor, backend: str,
             store_dist: bool, need_grad_x: bool, mean: bool = False) -> Outputs:
    """loss, lse_all, lse_pos, grad_x, dist (the contract), counted (B,) bool, and the counted
    mean and its divisor (0-dim; zeros without ``mean``)."""
    return _outputs(emb, labels, centres, centre_labels, neighbours, weights, sigma, backend,
                    store_dist, need_grad_x, mean)


def _outputs(emb, labels, centres, centre_labels, neighbours, weights, sigma, backend,
             store_dist, need_grad_x, mean=False, lean=False) -> Outputs:
    """:func:`_forward`; with ``lean`` (the eager carrier) the backend may leave out what the
    backward does not read."""
    out = by_name(backend).forward(emb, labels, centres, centre_labels, neighbours, weights,
                                   sigma, store_dist, need_grad_x, mean, lean)
    if mean:
        return out
    zero = out[0].new_zeros(())
    return out + (reference.counted_rows(out[2]), zero, zero.clone())


_nk_forward = torch.library.custom_op("nnkloss::nk_forward", _forward, mutates_args=())


@_nk_forward.register_fake
def _nk_forward_fake(emb, labels, centres, centre_labels, neighbours, weights, sigma, backend,
                     store_dist, need_grad_x, mean=False):
    out = reference.empty_outputs(emb, neighbours.shape[1], store_dist, need_grad_x)
    return out + (emb.new_empty(emb.shape[0], dtype=torch.bool), out[0].new_empty(()),
                  out[0].new_empty(()))


@torch.library.custom_op("nnkloss::nk_centre_grad", mutates_args=())
def _nk_centre_grad(emb: Tensor, centres: Tensor, neighbours: Tensor, coef: Tensor,
                    backend: str) -> Tensor:
    return by_name(backend).centre_grad(emb, centres, neighbours, coef.contiguous())


@_nk_centre_grad.register_fake
def _nk_centre_grad_fake(emb, centres, neighbours, coef, backend):
    return emb.new_empty(centres.shape[0], emb.shape[1], dtype=reference.compute_dtype(emb))


def _setup_context(ctx, inputs, output):
    emb = inputs[0]
    need = ctx.needs_input_grad
    # emb's gradient needs grad_x, lse_pos, the divisor and emb (which a recorded backward's
    # error hangs on); the others' per-entry terms also the inputs, lse_all and distances.
    if need[2] or need[5] or need[6]:
        ctx.save_for_backward(output[3], output[2], output[7], *inputs[:7], output[1], output[4])
    else:
        ctx.save_for_backward(output[3], output[2], output[7], emb)
    ctx.emb = (emb.dtype, emb.shape[1])
    ctx.backend = inputs[7]
    ctx.mean = len(inputs) > 10 and inputs[10]  # without it the mean outputs are zeros
    # Only the loss's and the mean's gradients are used: the others arrive as None.
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, _g_lse_all, _g_lse_pos, _g_grad_x, _g_dist, _g_counted, g_mean,
              _g_divisor):
    if not ctx.mean:
        g_mean = None
    if g_loss is None and g_mean is None:
        return (None,) * 11
    grad_x, lse_pos, divisor, *terms = ctx.saved_tensors
    impl = by_name(ctx.backend)
    need = ctx.needs_input_grad
    need_emb, need_c, need_w, need_s = need[0], need[2], need[5], need[6]
    # Each row's gradient: g_loss, or the mean's g / divisor (folded into the passes below).
    g, div = (g_mean, divisor) if g_loss is None else (g_loss, None)
    if g_loss is not None and g_mean is not None:
        g = g_loss + g_mean / divisor
    grad_emb = grad_c = grad_w = grad_s = None
    if need_emb:
        emb_dtype, D = ctx.emb
        if grad_x.shape[1] != D:
            raise RuntimeError("nnkloss::nk_forward was called with need_grad_x=False, so it "
                               "cannot give emb a gradient")
        # One pass that applies the row rule too: rows with lse_pos -inf or g 0 take nothing.
        grad_emb = impl.scale_rows(grad_x, g, lse_pos, emb_dtype, div)
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is an error
            grad_emb = _FirstOrderOnly.apply(grad_emb, terms[0])
    if need_c or need_w or need_s:
        emb, labels, centres, centre_labels, neighbours, weights, sigma, lse_all, u = terms
        g_rows = (g if div is None else g / div).expand(lse_pos.shape)
        coef, q, srow = impl.entry_grads(u, labels, centre_labels, neighbours, weights,
                                         lse_all, lse_pos, g_rows, sigma, need_c, need_w,
                                         need_s)
        cdt = u.dtype
        if need_s:
            grad_s = (srow.sum() / sigma.to(cdt)).to(sigma.dtype).reshape(sigma.shape)
        if coef is not None:
            grad_c = torch.ops.nnkloss.nk_centre_grad(emb, centres, neighbours, coef,
                                                      ctx.backend).to(centres.dtype)
        if q is not None:
            grad_w = torch.zeros(weights.shape[0], dtype=cdt, device=weights.device)
            if weights.shape[0]:  # an empty bank (all lists padding): nothing to scatter into
                # Padding (q 0) lands on row 0; an entry past the bank (checks off: its q is
                # NaN) on the last row, visibly, never outside the tensor.
                grad_w.index_add_(0, neighbours.clamp(0, weights.shape[0] - 1).long()
                                  .reshape(-1), q.reshape(-1))
            grad_w = grad_w.to(weights.dtype)
    return grad_emb, None, grad_c, None, None, grad_w, grad_s, None, None, None, None


torch.library.register_autograd("nnkloss::nk_forward", _backward, setup_context=_setup_context)


class _FirstOrderOnly(torch.autograd.Function):
    """The embedding gradient of a recorded backward: the op has no formula for its own
    derivative (it would need grad_x's), so differentiating it is an error, never a zero."""

    @staticmethod
    def forward(ctx, grad_emb, emb):  # emb: the output takes emb's requires_grad
        return grad_emb.view_as(grad_emb)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("nnkloss::nk_forward has no double-backward formula for the "
                           "embeddings' gradient")


class NeighbourKernelFunction(torch.autograd.Function):
    """``nnkloss::nk_forward``'s definition for eager calls: ``(per_row, counted, mean)``, the
    rest saved for backward. ``forward`` calls setup_context itself (a separate one makes torch
    bind the arguments through ``inspect.signature`` on every apply)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _outputs(*inputs, lean=True)
        _setup_context(ctx, inputs, output)
        return output[0], output[5], output[6]

    @staticmethod
    def backward(ctx, g_loss, _g_counted, g_mean):
        return _backward(ctx, g_loss, None, None, None, None, None, g_mean, None)


def loss_rows(emb, labels, centres, centre_labels, neighbours, weights, sigma: Tensor,
              backend: str, reduction: str) -> Tuple[Tensor, Tensor, Tensor]:
    """The op without checks: ``(loss, per_row (B,), counted (B,) bool)``; ``sigma`` a 0-dim
    tensor on emb's device, ``backend`` a concrete name, labels :func:`as_index`'d."""
    grad_mode = torch.is_grad_enabled()  # False under no_grad and inference_mode
    # Distances are stored only for a weight, sigma or centre gradient, grad_x computed only
    # when emb takes one: with neither the op is forward-only.
    store_dist = grad_mode and (centres.requires_grad or sigma.requires_grad
                                or (weights is not None and weights.requires_grad))
    need_grad_x = grad_mode and emb.requires_grad
    args = (emb.contiguous(), labels.contiguous(), centres.contiguous(),
            as_index(centre_labels).contiguous(), neighbours.contiguous(),
            None if weights is None else weights.contiguous(), sigma, backend, store_dist,
            need_grad_x, reduction == "mean")
    # Traced, under a dispatch mode, or a tensor subclass among the inputs: the custom op.
    if plain_eager(*(args[:7] if weights is not None else args[:5] + (sigma,))):
        per_row, counted, mean = NeighbourKernelFunction.apply(*args)
    else:
        out = torch.ops.nnkloss.nk_forward(*args)
        per_row, counted, mean = out[0], out[5], out[6]
    if reduction == "mean":
        return mean, per_row, counted
    return (per_row.sum() if reduction == "sum" else per_row), per_row, counted


def loss_rows_unchecked(emb, labels, centres, centre_labels, neighbours, weights,
                        sigma: Tensor, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """``(per_row, counted)`` of the op without checks (:func:`loss_rows`, "none")."""
    name = resolve(backend, emb.device, emb.dtype).name
    _, per_row, counted = loss_rows(emb, as_index(labels), centres, centre_labels, neighbours,
                                    weights, sigma, name, "none")
    return per_row, counted


class LossOutput(NamedTuple):
    """Result of :func:`neighbour_kernel_loss_with_stats`.

    loss: the reduced loss (0-dim, or (B,) for reduction="none").
    per_row: (B,) loss of each row, 0 for rows without a same-class neighbour, NaN for rows
        touched by a non-finite value.
    counted: (B,) bool, True where the row is counted in the mean: it had a same-class neighbour,
        or it is non-finite (its NaN reaches the mean instead of leaving it silently).
    """
    loss: Tensor
    per_row: Tensor
    counted: Tensor

    @property
    def num_counted(self) -> Tensor:
        """Number of rows counted in the mean (a 0-dim tensor: reading it syncs on GPU)."""
        return self.counted.sum()

    @property
    def nonfinite(self) -> Tensor:
        """(B,) bool: rows whose loss is NaN/inf (a non-finite embedding, centre or weight, or
        distances beyond the compute dtype's range)."""
        return ~torch.isfinite(self.per_row)

    @property
    def num_nonfinite(self) -> Tensor:
        """Number of non-finite rows (a 0-dim tensor: reading it syncs on GPU)."""
        return self.nonfinite.sum()


def reduce_rows(per_row: Tensor, counted: Tensor, reduction: str) -> Tensor:
    """The losses' reduction: "none" (per_row), "sum", or "mean" over the ``counted`` rows
    (0 when none is counted). Shared by every loss of the package."""
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    return reference.counted_mean(per_row, counted)[0]


def neighbour_kernel_loss_with_stats(emb, labels, centres, centre_labels, neighbours,
                                     weights=None, sigma=1.0, reduction="mean",
                                     backend="auto") -> LossOutput:
    """Like :func:`neighbour_kernel_loss`, but also returns the per-row losses and which rows
    had a same-class neighbour (``.counted``, ``.num_counted``)."""
    check_inputs(emb, labels, centres, centre_labels, neighbours, weights, reduction, backend)
    sigma_t = check_sigma(sigma, emb.device)
    impl = resolve(backend, emb.device, emb.dtype)
    # A row that gathers a non-finite centre comes out NaN (ops/CONTRACT.md rule 6): on CPU
    # tensors the gathered centres are checked from the losses after the op.
    after = check_values(emb, centres, neighbours, weights, sigma_t, centres_after_op=True,
                         fused=impl)
    loss, per_row, counted = loss_rows(emb, as_index(labels), centres, centre_labels,
                                       neighbours, weights, sigma_t, impl.name, reduction)
    if after:  # the sum and the mean are NaN exactly when a row is: one number to read
        check_gathered_centres_after_op(per_row if reduction == "none" else loss, centres,
                                        neighbours, impl)
    return LossOutput(loss, per_row, counted)


def neighbour_kernel_loss(emb, labels, centres, centre_labels, neighbours, weights=None,
                          sigma=1.0, reduction="mean", backend="auto") -> Tensor:
    """Nearest-neighbour Gaussian kernel loss (Meyer et al., ICIP 2018, Eq. 3).

    For each row b: ``-log( sum_{j in N_b, y_j = labels[b]} w_j k(x_b, c_j) / sum_{j in N_b} w_j
    k(x_b, c_j) )`` with ``k(x, c) = exp(-||x - c||^2 / (2 sigma^2))``, computed with
    log-sum-exp so that it stays finite however far the embeddings are from their centres.

    Args:
        emb: (B, D) fp16/bf16/fp32/fp64 embeddings.
        labels: (B,) integer class labels.
        centres: (N, D) fp16/bf16/fp32/fp64 kernel centres.
        centre_labels: (N,) integer labels of the centres.
        neighbours: (B, K) int32/int64 indices into ``centres``; -1 = padding. Duplicates count
            as many times as they appear.
        weights: (N,) non-negative per-centre weights, or None for all ones. A zero weight
            removes that centre.
        sigma: kernel width, a positive float or a 0-dim tensor (may require grad).
        reduction: "mean" (over rows that have a same-class neighbour), "sum" or "none" ((B,)).
        backend: "auto" (Triton for CUDA tensors, the compiled CPU kernel for CPU tensors),
            "triton" (also CPU tensors under TRITON_INTERPRET=1), "cpu" or "torch" (the plain
            PyTorch path, any device).

    Rows whose list holds no same-class centre contribute zero loss and zero gradient and are
    left out of the mean; :func:`neighbour_kernel_loss_with_stats` returns which rows those are.
    Gradients flow to ``emb`` and to ``centres``, ``weights`` and ``sigma`` when they require
    grad. Math is fp32 (fp64 for fp64 ``emb``) whatever the input dtypes; the loss is returned
    in that dtype.

    Value checks (``nnkloss.value_checks``, on by default): an index out of range raises
    IndexError; a NaN/inf in ``emb``, in a centre row that ``neighbours`` gathers, or in
    ``weights``, or a bad ``sigma``, raises ValueError naming it. All are checked before the
    op (one host sync on a GPU), except the gathered centres of CPU tensors: those are checked
    just after the op, from its per-row losses (a row that gathers a non-finite centre value
    comes out NaN), and read only when some row is NaN; the call raises the same error. A NaN
    row with finite inputs (a scaled distance beyond the compute dtype, e.g. ``|x| ~ 1e20``
    with ``sigma = 1`` in fp32) is not an error: its NaN propagates. A centre that no list
    gathers is never read. With the checks off nothing is checked: a non-finite value makes
    the rows it touches NaN, and so does a list entry >= N on the Triton and CPU backends
    (nothing is read through it; ops/CONTRACT.md rule 9), where the torch backend's indexing
    raises.
    """
    return neighbour_kernel_loss_with_stats(emb, labels, centres, centre_labels, neighbours,
                                            weights, sigma, reduction, backend).loss
