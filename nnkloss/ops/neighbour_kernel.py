"""The neighbour-kernel op: its registration, host backward, and functional entry points.

In the order of a reading: the two custom ops (``nnkloss::nk_forward``,
``nnkloss::nk_centre_grad``, registered with ``torch.library.custom_op`` so that
``torch.compile`` treats them as opaque calls, no graph break), dispatched to a backend of
:mod:`nnkloss.ops.backends` (Triton kernels of ``kernels/``, or the plain PyTorch path of
:mod:`nnkloss.ops.reference`); the CPU backend's two backward helpers, also custom ops
(``nnkloss::nk_scale_rows``: the embedding gradient; ``nnkloss::nk_entry_grads``: the
per-entry terms of the centre, weight and sigma gradients, one compiled pass instead of the
torch form's (B, K) ops); the one autograd definition that serves every backend (B x K /
B x D elementwise work from the forward's saved outputs, plus, only when centres require grad,
the centre-gradient scatter, itself an op that other losses call too), registered on the
custom op and carried in eager mode by an autograd.Function made of the same three functions
(``_EagerForward``: no dispatch cost); then the functional API and its reduction.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import reference
from .backends import implementation, resolve_backend
from ..validation import (as_index, check_gathered_centres_after_op, check_inputs,
                          check_sigma, check_values, plain_eager)

__all__ = ["neighbour_kernel_loss", "neighbour_kernel_loss_with_stats", "LossOutput",
           "loss_rows_unchecked", "reduce_rows", "counted_rows"]


def _forward(emb: Tensor, labels: Tensor, centres: Tensor, centre_labels: Tensor,
             neighbours: Tensor, weights: Optional[Tensor], sigma: Tensor,
             backend: str, store_dist: bool,
             need_grad_x: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # need_grad_x False is the forward-only path: no gradient term is computed on any backend
    # and grad_x comes back (B, 0) (ops/CONTRACT.md).
    return implementation(backend).forward(emb, labels, centres, centre_labels, neighbours,
                                           weights, sigma, store_dist=store_dist,
                                           need_grad_x=need_grad_x)


_nk_forward = torch.library.custom_op("nnkloss::nk_forward", _forward, mutates_args=())


@_nk_forward.register_fake
def _nk_forward_fake(emb, labels, centres, centre_labels, neighbours, weights, sigma, backend,
                     store_dist, need_grad_x):
    return reference.empty_outputs(emb, neighbours.shape[1], store_dist, need_grad_x)


@torch.library.custom_op("nnkloss::nk_centre_grad", mutates_args=())
def _nk_centre_grad(emb: Tensor, centres: Tensor, neighbours: Tensor, coef: Tensor,
                    backend: str) -> Tensor:
    return implementation(backend).centre_grad(emb, centres, neighbours, coef.contiguous())


@_nk_centre_grad.register_fake
def _nk_centre_grad_fake(emb, centres, neighbours, coef, backend):
    return emb.new_empty(centres.shape[0], emb.shape[1], dtype=reference.compute_dtype(emb))


@torch.library.custom_op("nnkloss::nk_scale_rows", mutates_args=())
def _nk_scale_rows(grad_x: Tensor, g: Tensor, lse_pos: Tensor) -> Tensor:
    """``g[:, None] * grad_x``, 0 where g == 0 or lse_pos == -inf, by the compiled CPU
    kernel's threads (:func:`nnkloss.ops.cpu.scale_rows`)."""
    from .. import cpu
    return cpu.scale_rows(grad_x, g, lse_pos)


@_nk_scale_rows.register_fake
def _nk_scale_rows_fake(grad_x, g, lse_pos):
    return torch.empty_like(grad_x)


def _scale_rows_cpu(grad_x, g, lse_pos):
    """The CPU backend's embedding gradient (:func:`nnkloss.ops.cpu.scale_rows`): called
    directly, without the custom op's dispatch (~8 us of a ~90 us backward), unless this
    backward is itself recorded (create_graph=True: grad mode is on here)."""
    if not torch.is_grad_enabled() and plain_eager(grad_x, g):
        from .. import cpu
        return cpu.scale_rows(grad_x, g, lse_pos)
    return torch.ops.nnkloss.nk_scale_rows(grad_x, g, lse_pos)


def _scale_rows_fused(backend, grad_x, g_loss, lse_pos, out_dtype):
    """The embedding gradient of the backward in one pass (see _backward), or None where the
    torch form must run: the Triton kernel only on plain tensors outside a recorded backward
    (traced, it is the torch form that torch.compile fuses; create_graph=True needs it
    differentiable); the CPU library always (directly or through its custom op)."""
    if backend == "cpu":
        return _scale_rows_cpu(grad_x, g_loss.to(grad_x.dtype), lse_pos).to(out_dtype)
    if backend == "triton" and not torch.is_grad_enabled() and plain_eager(grad_x, g_loss):
        from .backends import kernels
        return kernels().scale_rows(grad_x, g_loss, lse_pos, out_dtype)
    return None


@torch.library.custom_op("nnkloss::nk_entry_grads", mutates_args=())
def _nk_entry_grads(u: Tensor, labels: Tensor, centre_labels: Tensor, neighbours: Tensor,
                    weights: Optional[Tensor], lse_all: Tensor, lse_pos: Tensor, g: Tensor,
                    sigma: Tensor, need_c: bool, need_w: bool,
                    need_s: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """The CPU backend's per-entry backward terms (:func:`nnkloss.ops.cpu.entry_grads`) as a
    custom op: ``(coef, q, srow)``, each empty (0,) where not asked for."""
    from .. import cpu
    out = cpu.entry_grads(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g,
                          sigma, need_c, need_w, need_s)
    if out is None:
        raise RuntimeError("nnkloss::nk_entry_grads needs the compiled CPU library and CPU "
                           "tensors")
    return tuple(u.new_empty(0) if t is None else t for t in out)


@_nk_entry_grads.register_fake
def _nk_entry_grads_fake(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g,
                         sigma, need_c, need_w, need_s):
    B, K = u.shape
    return (u.new_empty((B, K) if need_c else (0,)),
            u.new_empty((B, K) if need_w and weights is not None else (0,)),
            u.new_empty((B,) if need_s else (0,)))


def _entry_grads_cpu(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g,
                     sigma, need_c, need_w, need_s):
    """The CPU backend's per-entry backward terms (coef, q, srow: see
    :func:`nnkloss.ops.cpu.entry_grads`), called directly on plain tensors and through the
    custom op otherwise (traced, a dispatch mode, a subclass: the same compiled pass, the same
    bits); None where the torch form below must run: the library cannot, or this backward is
    itself recorded (create_graph=True: grad mode is on here)."""
    from .. import cpu
    if torch.is_grad_enabled():
        return None
    if plain_eager(u, lse_pos, g):  # None where the library does not take these tensors
        return cpu.entry_grads(u, labels, centre_labels, neighbours, weights, lse_all,
                               lse_pos, g, sigma, need_c, need_w, need_s)
    if not cpu.entry_grads_supported(u, labels, centre_labels, neighbours, weights, lse_all,
                                     lse_pos, g):
        return None
    coef, q, srow = torch.ops.nnkloss.nk_entry_grads(u, labels, centre_labels, neighbours,
                                                     weights, lse_all, lse_pos, g, sigma,
                                                     need_c, need_w, need_s)
    return (coef if need_c else None, q if need_w and weights is not None else None,
            srow if need_s else None)


def _entry_grads_fused(backend, u, labels, centre_labels, neighbours, weights, lse_all,
                       lse_pos, g, sigma, need_c, need_w, need_s):
    """The backward's per-entry terms (coef, q, srow) in one pass, or None where the torch form
    must run: the CPU library (:func:`_entry_grads_cpu`), or the Triton kernel
    (``kernels/entry_grads.py``) on plain tensors outside a recorded backward (traced, the
    torch form is what torch.compile fuses; create_graph=True needs it differentiable)."""
    if backend == "cpu":
        return _entry_grads_cpu(u, labels, centre_labels, neighbours, weights, lse_all,
                                lse_pos, g, sigma, need_c, need_w, need_s)
    if (backend == "triton" and not torch.is_grad_enabled()
            and plain_eager(u, labels, centre_labels, neighbours, lse_all, lse_pos, g, sigma)):
        from .backends import kernels
        return kernels().entry_grads(u, labels, centre_labels, neighbours, weights, lse_all,
                                     lse_pos, g, sigma, need_c, need_w, need_s)
    return None


def _scatter_entry_terms(emb, centres, neighbours, weights, coef, q, backend, cdt):
    """The centre and weight gradients from their per-entry terms, whichever form computed
    them: coef (B, K) through the centre-gradient op, q (B, K) (0 at padding) added into an
    (N,) gradient; None for a term not given."""
    grad_c = grad_w = None
    if coef is not None:
        grad_c = torch.ops.nnkloss.nk_centre_grad(emb, centres, neighbours, coef, backend)
        grad_c = grad_c.to(centres.dtype)
    if q is not None:
        grad_w = torch.zeros(weights.shape[0], dtype=cdt, device=weights.device)
        if weights.shape[0]:  # an empty bank (all lists padding): nothing to scatter into
            # Padding (q 0) lands on row 0; an entry past the bank (value checks off: its row
            # is NaN, so is its q) on the last row, visibly, never outside the tensor.
            grad_w.index_add_(0, neighbours.clamp(0, weights.shape[0] - 1).long().reshape(-1),
                              q.reshape(-1))
        grad_w = grad_w.to(weights.dtype)
    return grad_c, grad_w


def _setup_context(ctx, inputs, output):
    emb, labels, centres, centre_labels, neighbours, weights, sigma, backend, _, _ = inputs
    _, lse_all, lse_pos, grad_x, dist = output
    ctx.save_for_backward(emb, labels, centres, centre_labels, neighbours, weights, sigma,
                          lse_all, lse_pos, grad_x, dist)
    ctx.backend = backend
    # Only the loss's gradient is used: the four other outputs' gradients arrive as None
    # instead of zero tensors that autograd would fill (a (B, D) fill per backward for grad_x,
    # on torch's OpenMP pool).
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, _g_lse_all, _g_lse_pos, _g_grad_x, _g_dist):
    (emb, labels, centres, centre_labels, neighbours, weights, sigma,
     lse_all, lse_pos, grad_x, u) = ctx.saved_tensors
    if g_loss is None:  # the loss itself took no gradient (set_materialize_grads(False))
        return None, None, None, None, None, None, None, None, None, None
    need = ctx.needs_input_grad
    need_emb, need_c, need_w, need_s = need[0], need[2], need[5], need[6]
    cdt = grad_x.dtype
    if need_emb and grad_x.shape[1] != emb.shape[1]:
        # Only a direct call of the op can get here: loss_rows_unchecked asks for grad_x
        # whenever emb requires grad.
        raise RuntimeError("nnkloss::nk_forward was called with need_grad_x=False, so it "
                           "cannot give emb a gradient")
    grad_emb = None
    if need_emb:
        # One pass that also applies the row rule below (rows with lse_pos -inf or g 0 get 0):
        # no mask is built, and g_loss is read as autograd hands it over (an expanded scalar
        # after a mean). On CPU on the kernel's threads (torch's pool spins after each op); on
        # the GPU one launch instead of six (the training step there is bound by the host).
        grad_emb = _scale_rows_fused(ctx.backend, grad_x, g_loss, lse_pos, emb.dtype)
    # The fused passes serve this backward only where the embedding gradient, if asked for,
    # came from one too (else the torch form below computes every term, in one recorded graph).
    fused = grad_emb is not None or not need_emb
    if fused and not (need_c or need_w or need_s):
        return grad_emb, None, None, None, None, None, None, None, None, None
    # The centre, weight and sigma terms per entry in one pass (the form below, without its
    # dozens of (B, K) torch ops), unless this backward is itself recorded or traced.
    terms = _entry_grads_fused(ctx.backend, u, labels, centre_labels, neighbours, weights,
                               lse_all, lse_pos, g_loss, sigma, need_c, need_w,
                               need_s) if fused else None
    if terms is not None:
        coef, q, srow = terms
        grad_s = None
        if need_s:
            grad_s = (srow.sum() / sigma.to(cdt)).to(sigma.dtype).reshape(sigma.shape)
        grad_c, grad_w = _scatter_entry_terms(emb, centres, neighbours, weights, coef, q,
                                              ctx.backend, cdt)
        return grad_emb, None, grad_c, None, None, grad_w, grad_s, None, None, None
    # Rows without a same-class neighbour carry no gradient, whatever flows in; non-finite
    # rows (lse_pos NaN) are counted and pass their NaN on.
    counted = counted_rows(lse_pos)
    g = torch.where(counted, g_loss.to(cdt), torch.zeros((), dtype=cdt, device=g_loss.device))
    # A row that receives no gradient passes none on, NaN or not (0 * NaN would be NaN): a
    # caller may select the finite rows of reduction="none" and train on them.
    takes = (g != 0)[:, None]
    if need_emb and grad_emb is None:
        grad_emb = torch.where(takes, g[:, None] * grad_x, 0.0).to(emb.dtype)
    grad_c = grad_w = grad_s = None
    if need_c or need_w or need_s:
        # u = ||(c - x) / sigma||^2 was saved by the forward (store_dist=True); the exact
        # probabilities are recomputed from it by the same code the torch forward uses.
        inv_sigma = 1.0 / sigma.to(cdt)
        t = reference.row_terms(neighbours, u, labels, centre_labels, weights)
        bad = torch.isnan(lse_pos)[:, None] & takes
        dl = torch.where(takes, (t.all.p - t.pos.p) * g[:, None], 0.0)  # dLoss/dlogit_j * g
        dl = torch.where(bad, float("nan"), dl)
        if need_s:
            # dlogit_j/dsigma = u_j / sigma. sum_j dl_j = 0 in every row, so u_j may be shifted
            # by a per-row reference (the largest logit's) before the sum: huge terms no longer
            # cancel.
            # Rows that take no gradient are left out here too: their dl is 0, and 0 times a
            # non-finite u_j - ref would be NaN.
            ref = u.gather(1, t.logits.masked_fill(~t.valid, float("-inf")).argmax(1, keepdim=True))
            shifted = torch.where(t.valid & takes, u - ref, torch.zeros_like(u))
            grad_s = ((dl * shifted).sum() * inv_sigma).to(sigma.dtype).reshape(sigma.shape)
        coef = q = None
        if need_c:
            # dlogit_j/dc_j = (x - c_j) / sigma^2, so dL/dc_j = (p_j - p^R_j)(x - c_j) / sigma^2.
            # (docs/MATHS.md section 3; tests/test_reference.py and gradcheck check the sign.)
            coef = dl * (inv_sigma * inv_sigma)
        if need_w:
            # dL/dw_j = (p_j - p^R_j) / w_j: exact even where log w is below the logits'
            # resolution. For a zero weight (a removed centre) it is the one-sided derivative
            # exp(-u_j/2 - lse_all) - [same class] exp(-u_j/2 - lse_pos). For a far same-class
            # centre both terms can overflow where their difference does not (it is 0 when the
            # two sums hold the same entries), so that difference is taken in one piece:
            # -exp(-u_j/2 - lse_pos + log(1 - exp(lse_pos - lse_all))), lse_pos <= lse_all.
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
        grad_c, grad_w = _scatter_entry_terms(emb, centres, neighbours, weights, coef, q,
                                              ctx.backend, cdt)
    return grad_emb, None, grad_c, None, None, grad_w, grad_s, None, None, None


torch.library.register_autograd("nnkloss::nk_forward", _backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """``nnkloss::nk_forward`` for eager calls on plain tensors that autograd records: the
    op's own forward, setup_context and backward (the one autograd definition above), carried
    by an autograd.Function instead of the custom op. The op's dispatch and the autograd wrapper
    torch.library generates for it cost ~110-130 us of a ~1.0 ms forward+backward at B 1024,
    K 32, D 128 on the 2-core Intel Xeon's CPU backend (2026-11-25); under torch.compile,
    export or a dispatch mode the custom op runs (see loss_rows_unchecked).

    forward takes ctx and calls setup_context itself: with a separate ``setup_context``
    staticmethod, torch binds the call's arguments to forward's signature through
    ``inspect.signature`` on every apply (34 against 8 us a call, same machine)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward)


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


class _CountedMean(torch.autograd.Function):
    """reduce_rows's recorded mean in one call of a fused pass (``impl``, giving ``(mean,
    divisor)``: ``kernels/counted_mean.py``'s launch on CUDA; the tests also pair it with the
    CPU library's :func:`nnkloss.ops.cpu.counted_mean`, which has the same contract, to check
    it without a GPU). The backward is the torch form's: every row's gradient
    ``g / max(count, 1)`` (an expanded scalar, as autograd hands a mean's gradient on), from
    the divisor the pass wrote."""

    @staticmethod
    def forward(ctx, per_row, counted, impl):
        mean, divisor = impl(per_row, counted)
        ctx.save_for_backward(divisor)
        ctx.rows = per_row.shape[0]
        return mean

    @staticmethod
    def backward(ctx, g):
        divisor, = ctx.saved_tensors
        return (g / divisor).expand(ctx.rows), None, None


def _counted_mean_fused(per_row: Tensor, counted: Tensor) -> Optional[Tensor]:
    """The mean of reduce_rows in one call, or None where the torch form (sum, count_nonzero,
    clamp_min, div) runs: outside tracing (compile fuses that form itself), for the op's
    dtypes, and
    - on CUDA tensors with the Triton kernels installed, up to a batch's size
      (``COUNTED_MEAN_MAX_ROWS``: one program walks the rows), recorded or not: the forward
      is bound by the host there, and the form's four launches took ~100 us of it on an H200;
    - on CPU tensors once the compiled library is loaded, when no gradient is recorded
      (forward-only calls: evaluation, the classifier, no_grad). After the forward's kernel
      has swept the caches, the counted mask and the four ops took 41-44 us of a forward-only
      call at B 1024, K 32, D 128, the mask and the one call 25 (the 2-core Intel Xeon,
      2026-11-27; docs/PERFORMANCE.md, "The losses' mean in one call"); hot, both ~7 us.
      With a gradient the torch form stays: a Python Function's backward cost up to 7 us
      more a step there."""
    recorded = per_row.requires_grad and torch.is_grad_enabled()
    if not per_row.is_cuda:
        if recorded or not plain_eager(per_row, counted):
            return None
        from .. import cpu
        out = cpu.counted_mean(per_row, counted)  # None for what it does not take
        return None if out is None else out[0]
    if (per_row.dtype not in (torch.float32, torch.float64) or counted.dtype != torch.bool
            or per_row.dim() != 1 or counted.shape != per_row.shape
            or not plain_eager(per_row, counted)):
        return None
    from .backends import fused_pass
    kernels = fused_pass(per_row.device)
    if kernels is None or per_row.shape[0] > kernels.COUNTED_MEAN_MAX_ROWS:
        return None
    if recorded:
        return _CountedMean.apply(per_row, counted, kernels.counted_mean)
    return kernels.counted_mean(per_row, counted)[0]


def reduce_rows(per_row: Tensor, counted: Tensor, reduction: str) -> Tensor:
    """The losses' reduction: "none" (per_row), "sum", or "mean" over the ``counted`` rows
    (0 when none is counted). Shared by every loss of the package."""
    if reduction == "none":
        return per_row
    if reduction == "mean":
        fused = _counted_mean_fused(per_row, counted)
        if fused is not None:
            return fused
    total = per_row.sum()
    if reduction == "sum":
        return total
    # the count divides as total's dtype (int64 / float promotes); count_nonzero: one op fewer
    # than a sum and a cast (~2 us of a CPU call)
    return total / torch.count_nonzero(counted).clamp_min(1)


def loss_rows_unchecked(emb, labels, centres, centre_labels, neighbours, weights,
                        sigma: Tensor, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The op without validation: ``(per_row (B,), counted (B,) bool)``. ``sigma`` must
    already be a 0-dim tensor on emb's device. Counted rows are those with a same-class
    neighbour, and non-finite rows (lse_pos NaN), whose NaN must reach the mean."""
    backend = resolve_backend(backend, emb.device)
    grad_mode = torch.is_grad_enabled()  # False under no_grad and inference_mode
    # The (B, K) distances are stored only when a weight, sigma or centre gradient needs them,
    # and the (B, D) embedding gradient computed only when emb takes one: with neither (no
    # input requires grad, no_grad, inference_mode) the op is forward-only on every backend.
    store_dist = grad_mode and (centres.requires_grad or sigma.requires_grad
                                or (weights is not None and weights.requires_grad))
    need_grad_x = grad_mode and emb.requires_grad
    # Labels of another integer dtype as int64 (torch's comparisons refuse to promote uint16 /
    # uint32 / uint64 against the other's int32 / int64).
    args = (emb.contiguous(), as_index(labels).contiguous(), centres.contiguous(),
            as_index(centre_labels).contiguous(), neighbours.contiguous(),
            None if weights is None else weights.contiguous(), sigma)
    # Traced (torch.compile, export), under a dispatch mode, or a tensor subclass among the
    # inputs: the custom op, as registered.
    if not plain_eager(*(t for t in args if t is not None)):
        per_row, _, lse_pos, _, _ = torch.ops.nnkloss.nk_forward(*args, backend, store_dist,
                                                                  need_grad_x)
    elif not (store_dist or need_grad_x):
        # Forward only, in eager mode on plain tensors: autograd has nothing to record, so the
        # backend runs directly; the custom op's dispatch cost ~8 us per call, ~3% of the
        # forward at B 1024, K 32, D 128 on CPU (measured 2026-11-24). On the AMD EPYC family
        # 26 (2026-11-27, K 32, D 128, median of 5 x 200 calls) it cost 9 us at B 1, 28 us at
        # B 1024 and 112 us at B 4096 (~9% of the call): its Python runs after the kernel, on
        # caches the kernel has swept. Same function, same outputs
        # (tests/test_ops_neighbour_kernel.py).
        per_row, _, lse_pos, _, _ = _forward(*args, backend, False, False)
    else:  # eager, with a gradient to record: the same op as an autograd.Function
        per_row, _, lse_pos, _, _ = _EagerForward.apply(*args, backend, store_dist,
                                                         need_grad_x)
    return per_row, counted_rows(lse_pos)


def counted_rows(lse_pos: Tensor) -> Tensor:
    """(B,) bool: the rows the mean counts, those whose lse_pos is not -inf (a same-class
    neighbour, or NaN: a non-finite row's NaN must reach the mean). isneginf and an in-place
    not: 1.5 us at B 1024 on the 2-core AMD EPYC family 26, where ``!= float("-inf")`` took
    2.7 (its Python scalar is wrapped into a tensor on every call). On a GPU the launches cost,
    not the wrapping: there the comparison is one launch instead of two."""
    if lse_pos.is_cuda:
        return lse_pos != float("-inf")
    return lse_pos.isneginf().logical_not_()


def neighbour_kernel_loss_with_stats(emb, labels, centres, centre_labels, neighbours,
                                     weights=None, sigma=1.0, reduction="mean",
                                     backend="auto") -> LossOutput:
    """Like :func:`neighbour_kernel_loss`, but also returns the per-row losses and which rows
    had a same-class neighbour (``.counted``, ``.num_counted``)."""
    check_inputs(emb, labels, centres, centre_labels, neighbours, weights, reduction, backend)
    sigma_t = check_sigma(sigma, emb.device)
    # Every backend follows rule 6 of ops/CONTRACT.md (a row that gathers a non-finite centre
    # value comes out NaN), so on CPU tensors the gathered centres are checked from the rows'
    # losses after the op, not read (B x K x D values) before it.
    centres_after_op = check_values(emb, centres, neighbours, weights, sigma_t,
                                    centres_after_op=True)
    per_row, counted = loss_rows_unchecked(emb, labels, centres, centre_labels, neighbours,
                                           weights, sigma_t, backend)
    loss = reduce_rows(per_row, counted, reduction)
    if centres_after_op:
        # the sum and the mean are NaN exactly when a row is: one number to read
        check_gathered_centres_after_op(per_row if reduction == "none" else loss, centres,
                                        neighbours)
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
