"""nnkloss/ops/neighbour_kernel.py: the functional op (custom-op registration, host backward),
through the torch and Triton backends, against the fp64 reference: values and every gradient."""
import pytest
import torch

import nnkloss
from cases import (BACKENDS, SHAPES, check_rows_close, compare, make_case, run_op, run_ref,
                   spy_backend_forward)
from reference import reference_loss, reference_loss_rows

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_fp64(backend, shape):
    case = make_case(*shape, pad=0.2)
    compare(case, backend, emb_dtype=torch.float64, bank_dtype=torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_matches_reference_low_precision(backend, bank_dtype, shape):
    case = make_case(*shape, pad=0.1, seed=1)
    compare(case, backend, emb_dtype=torch.float32, bank_dtype=bank_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_embeddings(backend):
    case = make_case(6, 30, 12, 7, seed=2)
    compare(case, backend, emb_dtype=torch.bfloat16, bank_dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_per_row_check_allows_the_fp32_rounding_of_the_logits_and_no_more(backend):
    """At D 512 the logits reach |l| ~ 300, whose fp32 ulp (3e-5) is over the flat 2e-5: the
    per-row check (cases.check_rows_close) allows a few epsilons of each row's logit scale, as
    the op's fp32 rows need (seen on an H200 and on this CPU, up to 2 eps x scale), and still
    rejects an error of 2e-4 on a row whose loss is 0."""
    emb, labels, centres, cl, nb, w = make_case(48, 400, 512, 32, pad=0.1, seed=5)
    e, c = emb.float(), centres.float()
    rows_ref, valid_ref, _ = run_ref(e, labels, c, cl, nb, w, 1.3)
    out, _ = run_op(backend, e, labels, c, cl, nb, w, 1.3, grads=False)
    tol = dict(rtol=2e-4, atol=2e-5)
    check_rows_close(out.per_row, rows_ref, tol, e, c, nb, w, 1.3)
    zero = int(torch.where(valid_ref, rows_ref, torch.inf).argmin())
    assert rows_ref[zero] < 1e-6
    off = out.per_row.detach().clone()
    off[zero] += 2e-4
    with pytest.raises(AssertionError, match="1 of 48 rows off"):
        check_rows_close(off, rows_ref, tol, e, c, nb, w, 1.3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(backend, reduction):
    case = make_case(7, 20, 5, 6, seed=3, pad=0.3)
    compare(case, backend, emb_dtype=torch.float64, bank_dtype=torch.float64, reduction=reduction)


def test_the_mean_is_one_call_of_the_cpu_library_in_eager_mode(monkeypatch):
    """The op's mean on CPU tensors: computed by the compiled library's forward call itself
    (with a gradient too: the op's one autograd Function divides it in the backward);
    reduce_rows, the other losses' mean, is torch's form (compiled too), any mask dtype."""
    from nnkloss import cpu
    from nnkloss.ops import neighbour_kernel as op
    assert cpu.available()
    calls = []  # the forward calls that computed the mean too
    real_forward = cpu.forward

    def spy(*args):
        out = real_forward(*args)
        if len(out) == 8:
            calls.append(1)
        return out

    monkeypatch.setattr(nnkloss.ops.neighbour_kernel.by_name("cpu"), "forward", spy)
    gen = torch.Generator().manual_seed(0)
    rows = torch.rand(300, generator=gen)
    counted = rows > 0.4
    rows = torch.where(counted, rows, 0.0)
    want = rows.sum() / torch.count_nonzero(counted)
    torch.testing.assert_close(op.reduce_rows(rows, counted, "mean"), want, rtol=1e-6, atol=0)
    x = rows.detach().clone().requires_grad_(True)
    loss = op.reduce_rows(x, counted, "mean")
    assert type(loss.grad_fn).__name__ == "DivBackward0"
    loss.backward()
    assert torch.equal(x.grad, torch.full_like(x, 1.0) / torch.count_nonzero(counted))
    half = rows.half()
    assert torch.equal(op.reduce_rows(half, counted, "mean"),
                       half.sum() / torch.count_nonzero(counted))
    assert torch.equal(op.reduce_rows(rows, counted.int(), "mean"), want)  # another mask dtype
    compiled = torch.compile(lambda r, c: op.reduce_rows(r, c, "mean"), fullgraph=True)
    torch.testing.assert_close(compiled(rows, counted), want, rtol=1e-6, atol=0)
    assert calls == []
    # the op's loss: one call, NaN rows reach the mean; with a gradient, g / count per row
    emb, labels, centres, cl, nb, w = make_case(7, 20, 5, 6, seed=3)
    emb[2] = float("nan")
    with nnkloss.value_checks(False):
        out = nnkloss.neighbour_kernel_loss_with_stats(emb, labels, centres, cl, nb, w,
                                                       backend="cpu")
    assert len(calls) == 1 and torch.isnan(out.loss)
    e = make_case(7, 20, 5, 6, seed=3)[0].float().requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(e, labels, centres.float(), cl, nb, backend="cpu")
    rows = nnkloss.neighbour_kernel_loss_with_stats(e, labels, centres.float(), cl, nb,
                                                    reduction="none", backend="cpu")
    assert len(calls) == 2
    want = rows.per_row.sum() / rows.counted.sum()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    (g_loss,) = torch.autograd.grad(loss, e)
    (g_want,) = torch.autograd.grad(want, e)
    torch.testing.assert_close(g_loss, g_want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_all_padding_and_no_positive_rows(backend):
    emb, labels, centres, cl, nb, w = make_case(6, 12, 4, 5, seed=4)
    nb[0] = -1                      # all padding
    cl[:] = 0
    labels[1] = 2                   # no centre of class 2 anywhere: no positive
    labels[2:] = 0
    nb[3, 2:] = -1                  # partly padded
    out = compare((emb, labels, centres, cl, nb, w), backend, torch.float64, torch.float64)
    assert out.counted.tolist() == [False, False, True, True, True, True]
    assert out.num_counted.item() == 4
    assert out.per_row[0].item() == 0.0 and out.per_row[1].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_positive_anywhere_gives_zero_and_zero_grad(backend):
    emb, labels, centres, cl, nb, w = make_case(3, 8, 4, 4, seed=5)
    cl[:] = 1
    labels[:] = 0
    emb.requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(emb.grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_count_as_many_times_as_they_appear(backend):
    emb, labels, centres, cl, _, w = make_case(2, 6, 3, 1, seed=6)
    nb = torch.tensor([[0, 1, 1, 1], [2, 2, 3, -1]])
    compare((emb, labels, centres, cl, nb, w), backend, torch.float64, torch.float64)
    # Explicit check: row 0 with entry 1 three times equals weighting centre 1 by 3.
    w3 = torch.ones(6, dtype=torch.float64)
    w3[1] = 3.0
    b = nnkloss.neighbour_kernel_loss(emb[:1], labels[:1], centres, cl, torch.tensor([[0, 1]]),
                                      w3, backend=backend)
    a = nnkloss.neighbour_kernel_loss(emb[:1], labels[:1], centres, cl, nb[:1], backend=backend)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [1e2, 1e4])
def test_huge_distances_stay_finite(backend, offset):
    """Positives far beyond the point where exp() underflows: still finite and exact."""
    emb, labels, centres, cl, nb, w = make_case(4, 10, 6, 6, seed=7)
    labels[:] = 0
    cl[:] = 1
    cl[0] = 0
    centres[0] += offset            # the only positive is very far away
    nb[:, 0] = 0
    out = compare((emb, labels, centres, cl, nb, w), backend, torch.float64, torch.float64)
    assert (out.per_row > 0.4 * offset ** 2 * 0.5).all()  # ~ d / (2 sigma^2), sigma = 1.3
    # fp32 distances of ~offset^2 cannot be compared tightly; they must still be finite.
    out32, g32 = run_op(backend, emb.float(), labels, centres.float(), cl, nb, w.float(), 1.3)
    assert torch.isfinite(out32.per_row).all() and out32.counted.all()
    assert all(torch.isfinite(t).all() for t in g32.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_far_query_from_everything(backend):
    emb, labels, centres, cl, nb, w = make_case(3, 10, 5, 6, seed=8)
    emb = emb + 1e3
    compare((emb, labels, centres, cl, nb, w), backend, torch.float64, torch.float64)
    # In fp32, distances ~5e6 carry an absolute rounding error ~0.5, so only finiteness and a
    # loose agreement can be asked of them.
    out, g = run_op(backend, emb.float(), labels, centres.float(), cl, nb, w.float(), 1.3)
    assert torch.isfinite(out.per_row).all()
    assert all(torch.isfinite(t).all() for t in g.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_weight_removes_centre(backend):
    emb, labels, centres, cl, nb, w = make_case(5, 12, 4, 6, seed=9, C=2)
    # Pick a centre whose removal leaves every row's validity unchanged, so that the loss is
    # differentiable in w_j at 0 (the finite difference below needs that).
    for j in nb[0].tolist():
        removed = nb.masked_fill(nb == j, -1)
        if torch.equal(reference_loss_rows(emb, labels, centres, cl, removed, w)[1],
                       reference_loss_rows(emb, labels, centres, cl, nb, w)[1]):
            break
    else:
        raise AssertionError("test data has no suitable centre")
    w[j] = 0.0
    # Same loss as replacing that entry by padding everywhere.
    nb2 = nb.masked_fill(nb == j, -1)
    out, g = run_op(backend, emb, labels, centres, cl, nb, w, 1.3)
    _, _, g_ref = run_ref(emb, labels, centres, cl, nb2, w, 1.3)
    b = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb2, w, 1.3, backend=backend)
    torch.testing.assert_close(out.loss, b)
    for name in ("emb", "centres", "sigma"):
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-8, atol=1e-10)
    others = torch.arange(12) != j
    torch.testing.assert_close(g["weights"][others], g_ref["weights"][others], rtol=1e-8,
                               atol=1e-10)
    # At w_j = 0 the op gives the one-sided derivative, so a learned weight can come back.
    eps = 1e-7
    w_eps = w.clone()
    w_eps[j] = eps
    fd = (reference_loss(emb, labels, centres, cl, nb, w_eps, 1.3)
          - reference_loss(emb, labels, centres, cl, nb, w, 1.3)) / eps
    torch.testing.assert_close(g["weights"][j], fd, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_neighbours_and_labels(backend):
    emb, labels, centres, cl, nb, w = make_case(5, 12, 4, 6, seed=10)
    a = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, backend=backend)
    b = nnkloss.neighbour_kernel_loss(emb, labels.int(), centres, cl.int(), nb.int(), w,
                                      backend=backend)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint8, torch.int16])
def test_labels_of_any_integer_dtype(backend, dtype):
    """Labels and centre labels of any integer dtype give the int64 loss and gradient: the
    torch backend's comparisons refused to promote uint16 / uint32 against int64 (a
    RuntimeError naming no argument)."""
    emb, labels, centres, cl, nb, w = make_case(5, 12, 4, 6, seed=10)
    e = emb.clone().requires_grad_(True)
    a = nnkloss.neighbour_kernel_loss(e, labels, centres, cl, nb, w, backend=backend)
    a.backward()
    for lab, c in ((labels.to(dtype), cl), (labels, cl.to(dtype)), (labels.to(dtype), cl.to(dtype))):
        e2 = emb.clone().requires_grad_(True)
        b = nnkloss.neighbour_kernel_loss(e2, lab, centres, c, nb, w, backend=backend)
        b.backward()
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(e2.grad, e.grad)


def test_sigma_float_and_tensor_agree():
    emb, labels, centres, cl, nb, w = make_case(5, 12, 4, 6, seed=11)
    a = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma=0.7)
    b = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w,
                                      sigma=torch.tensor(0.7, dtype=torch.float64))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_op(backend):
    emb, labels, centres, cl, nb, w = make_case(4, 9, 3, 5, seed=13, pad=0.2)
    s = torch.tensor(0.9, dtype=torch.float64)
    args = [t.requires_grad_(True) for t in (emb, centres, w, s)]
    assert torch.autograd.gradcheck(
        lambda e, c, ww, ss: nnkloss.neighbour_kernel_loss(e, labels, c, cl, nb, ww, ss,
                                                           backend=backend), args)


def test_empty_batch():
    _, _, centres, cl, _, _ = make_case(1, 5, 3, 2)
    emb = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    out = nnkloss.neighbour_kernel_loss_with_stats(
        emb, torch.zeros(0, dtype=torch.long), centres, cl, torch.zeros(0, 2, dtype=torch.long))
    assert out.loss.item() == 0.0 and out.per_row.shape == (0,)
    out.loss.backward()
    assert emb.grad.shape == (0, 3)


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_empty_bank_with_trainable_weights():
    """Bug found by the test above: with weights that require grad, the backward scattered the
    (all-padding) rows' zero gradients into an empty weight tensor at index 0: IndexError."""
    emb = torch.randn(3, 4, requires_grad=True)
    weights = torch.empty(0, requires_grad=True)
    loss = nnkloss.neighbour_kernel_loss(
        emb, torch.tensor([0, 1, 0]), torch.empty(0, 4), torch.empty(0, dtype=torch.long),
        torch.full((3, 2), -1), weights, backend="torch")
    ge, gw = torch.autograd.grad(loss, [emb, weights])
    assert torch.equal(ge, torch.zeros(3, 4))
    assert gw.shape == (0,)


def test_functional_sigma_defaults_to_one():
    """Kills ops.neighbour_kernel neighbour_kernel_loss 1 (default ``sigma=2.0``)."""
    g = torch.Generator().manual_seed(5)
    emb, centres = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g)
    args = (emb, torch.tensor([0, 1, 0, 1]), centres, torch.tensor([0, 1, 0, 1, 0, 1]),
            torch.tensor([[0, 1, 2], [1, 2, 3], [3, 4, 5], [5, 0, 1]]))
    torch.testing.assert_close(nnkloss.neighbour_kernel_loss(*args),
                               nnkloss.neighbour_kernel_loss(*args, sigma=1.0), rtol=0, atol=0)
    assert not torch.allclose(nnkloss.neighbour_kernel_loss(*args),
                              nnkloss.neighbour_kernel_loss(*args, sigma=2.0))


def test_distances_are_stored_only_when_a_gradient_needs_them(monkeypatch):
    """The (B, K) distances are kept for the backward only when centres, weights or sigma take
    a gradient (memory: B*K per step for nothing otherwise). Kills ops.neighbour_kernel
    loss_rows_unchecked 9 and 11 (stored always / whenever grad mode is on), and 1, 2 (its
    default backend misspelt)."""
    from nnkloss.ops import neighbour_kernel as nk, reference
    seen = []
    real = reference.forward

    def spy(*args, store_dist=True, **kwargs):
        seen.append(store_dist)
        return real(*args, store_dist=store_dist, **kwargs)
    monkeypatch.setattr(reference, "forward", spy)
    g = torch.Generator().manual_seed(12)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    w, s = torch.rand(5, generator=g) + 0.5, torch.tensor(1.2)
    args = (torch.tensor([0, 1, 0]), None, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, 1]]))

    def run(e, c, ww, ss):
        labels, _, cl, nb = args
        return nk.loss_rows_unchecked(e, labels, c, cl, nb, ww, ss, backend="torch")
    run(emb.requires_grad_(True), centres, w, s)
    run(emb, centres.clone().requires_grad_(True), w, s)
    run(emb, centres, w.clone().requires_grad_(True), s)
    run(emb, centres, None, s.clone().requires_grad_(True))
    with torch.no_grad():
        run(emb, centres.clone().requires_grad_(True), w, s)
    assert seen == [False, True, True, True, False]
    labels, _, cl, nb = args
    rows, valid = nk.loss_rows_unchecked(emb.detach(), labels, centres, cl, nb, None, s)
    torch.testing.assert_close(rows, run(emb.detach(), centres, None, s)[0])


def test_stats_op_sigma_defaults_to_one():
    """Kills ops.neighbour_kernel neighbour_kernel_loss_with_stats 1 (default ``sigma=2.0``)."""
    g = torch.Generator().manual_seed(13)
    args = (torch.randn(4, 3, generator=g), torch.tensor([0, 1, 0, 1]),
            torch.randn(6, 3, generator=g), torch.tensor([0, 1, 0, 1, 0, 1]),
            torch.tensor([[0, 1, 2], [1, 2, 3], [3, 4, 5], [5, 0, 1]]))
    a = nnkloss.neighbour_kernel_loss_with_stats(*args).loss
    torch.testing.assert_close(a, nnkloss.neighbour_kernel_loss_with_stats(*args, sigma=1.0).loss,
                               rtol=0, atol=0)
    assert not torch.allclose(a, nnkloss.neighbour_kernel_loss_with_stats(*args, sigma=2.0).loss)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_backward_scales_rows_on_the_kernel_threads_only_for_the_cpu_backend(monkeypatch,
                                                                              backend):
    """Kills ops.neighbour_kernel _backward 32-34 (g * grad_x sent through nk_scale_rows for
    the wrong backends or for none: same numbers, other threads)."""
    from nnkloss import cpu
    calls = []
    real = cpu.scale_rows

    def spy(grad_x, g, lse_pos=None, divisor=None):
        calls.append(grad_x.shape)
        return real(grad_x, g, lse_pos, divisor)
    monkeypatch.setattr(cpu, "scale_rows", spy)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 4, generator=g, requires_grad=True)
    loss = nnkloss.neighbour_kernel_loss(
        x, torch.tensor([0, 1, 0]), torch.randn(5, 4, generator=g), torch.tensor([0, 1, 0, 1, 1]),
        torch.tensor([[0, 1], [2, 3], [4, 1]]), backend=backend)
    loss.backward()
    assert calls == ([(3, 4)] if backend == "cpu" else [])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_half_precision_sigma_is_widened_before_use(backend):
    """A 0-dim fp16 sigma tensor is taken at its exact value in the compute dtype, in the
    forward and in the backward. Kills ops.neighbour_kernel _backward 57 (1 / sigma taken in
    fp16 for the centre gradient)."""
    g = torch.Generator().manual_seed(16)
    emb = torch.randn(4, 5, generator=g)
    centres = torch.randn(7, 5, generator=g)
    args = (torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 0, 1, 0, 1, 0]),
            torch.tensor([[0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]]))
    s16 = torch.tensor(0.3, dtype=torch.float16)
    res = []
    for s in (s16, torch.tensor(float(s16))):
        c = centres.clone().requires_grad_(True)
        loss = nnkloss.neighbour_kernel_loss(emb, args[0], c, args[1], args[2], sigma=s,
                                             backend=backend)
        loss.backward()
        res.append((loss, c.grad))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=1e-6, atol=1e-7)


# -----------------------------------------------------------------------------------------------
# The embedding gradient of the Triton backend's backward: one launch (kernels/scale_rows.py)
# on plain tensors, the torch form where the backward is itself recorded.
@pytest.mark.interpreter
@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_triton_backward_scales_rows_in_one_kernel(monkeypatch, emb_dtype):
    kernels = nnkloss.ops.backends.kernels()
    calls = []
    real = kernels.scale_rows
    monkeypatch.setattr(kernels, "scale_rows", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(9)
    emb = torch.randn(7, 10, generator=g).to(emb_dtype)
    centres = torch.randn(40, 10, generator=g).to(emb_dtype)
    labels = torch.randint(0, 3, (7,), generator=g)
    cl = torch.randint(0, 3, (40,), generator=g)
    nb = torch.randint(0, 40, (7, 6), generator=g)
    cl[nb[3]] = (labels[3] + 1) % 3  # row 3 has no same-class neighbour
    upstream = torch.randn(7, generator=g, dtype=torch.float64 if emb_dtype == torch.float64
                           else torch.float32)
    upstream[5] = 0.0  # row 5 takes no gradient
    grads = {}
    for backend in ("torch", "triton"):
        x = emb.clone().requires_grad_(True)
        rows = nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, sigma=1.3,
                                             reduction="none", backend=backend)
        rows.backward(upstream)
        mean = nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, sigma=1.3,
                                             backend=backend)
        (x_mean,) = torch.autograd.grad(mean, x)
        grads[backend] = (x.grad, x_mean)
    assert len(calls) == 2 and calls[1][4] is not None  # the mean's gradient and divisor
    assert grads["triton"][0].dtype == emb_dtype
    assert (grads["triton"][0][[3, 5]] == 0).all() and grads["triton"][0].abs().sum() > 0
    tol = dict(rtol=2e-2, atol=1e-3) if emb_dtype == torch.bfloat16 else {}
    for a, b in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(a, b, **tol)
    # create_graph=True: the torch form (differentiable), not the kernel
    calls.clear()
    x = emb.clone().requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, sigma=1.3, backend="triton")
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    assert calls == [] and gx.requires_grad
    torch.testing.assert_close(gx.detach(), grads["triton"][1])


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_bank.py (issue 14 README promises; issue 19).
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bank_dtype", [torch.float16, torch.float32])
def test_fp16_embeddings(backend, bank_dtype):
    g = torch.Generator().manual_seed(6)
    emb = torch.randn(6, 12, generator=g).half().requires_grad_(True)
    centres = torch.randn(30, 12, generator=g).to(bank_dtype)
    labels = torch.randint(0, 3, (6,), generator=g)
    cl = torch.randint(0, 3, (30,), generator=g)
    nb = torch.randint(0, 30, (6, 9), generator=g)
    w = (torch.rand(30, generator=g) + 0.5).requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma=1.7,
                                         backend=backend)
    assert loss.dtype == torch.float32  # fp32 math for fp16 input
    loss.backward()
    assert emb.grad.dtype == torch.float16
    e64 = emb.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = reference_loss(e64, labels, centres.double(), cl, nb, w64, 1.7)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(emb.grad.double(), e64.grad.half().double(), rtol=1.6e-2,
                               atol=1e-3)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-3, atol=1e-5)


# -----------------------------------------------------------------------------------------------
# Value checks of the gathered centres: after the op on CPU tensors (nnkloss/validation.py).
CPU_BACKENDS = ["auto", "cpu", "torch"]
GATHERED_MSG = r"^centres contain NaN or inf in rows that neighbours gathers$"


def gathered_case(bank_dtype=torch.float32, seed=20):
    """6 rows, a bank of 9 centres (labels 0, 1, 2 in turn); centre 4 is gathered by row 2
    only, centre 8 by no row. emb is fp64 with an fp64 bank, fp32 otherwise."""
    g = torch.Generator().manual_seed(seed)
    emb_dtype = torch.float64 if bank_dtype == torch.float64 else torch.float32
    emb = torch.randn(6, 5, generator=g, dtype=emb_dtype)
    centres = torch.randn(9, 5, generator=g).to(bank_dtype)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    cl = torch.arange(9) % 3
    nb = torch.tensor([[0, 1, 2], [3, 5, 1], [4, 7, 0], [6, 3, -1], [1, 7, 5], [2, 0, 6]])
    return emb, labels, centres, cl, nb


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
def test_nonfinite_gathered_centre_raises_naming_centres(backend, bank_dtype, value):
    """Checked after the op on CPU tensors, and the same error as before it: the call raises
    (whatever the reduction, with or without gradients), never returns a NaN loss."""
    emb, labels, centres, cl, nb = gathered_case(bank_dtype)
    centres[4, 3] = value  # row 2 only
    for reduction in ("mean", "none"):
        with pytest.raises(ValueError, match=GATHERED_MSG):
            nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, reduction=reduction,
                                          backend=backend)
    with pytest.raises(ValueError, match=GATHERED_MSG):
        nnkloss.neighbour_kernel_loss_with_stats(emb.clone().requires_grad_(True), labels,
                                                 centres.clone().requires_grad_(True), cl, nb,
                                                 torch.ones(9, requires_grad=True),
                                                 torch.tensor(1.3, requires_grad=True),
                                                 backend=backend)
    with nnkloss.value_checks(False):  # off: no error, the NaN shows in the rows it touches
        out = nnkloss.neighbour_kernel_loss_with_stats(emb, labels, centres, cl, nb,
                                                       backend=backend)
    assert torch.isnan(out.per_row[2]) and torch.isnan(out.loss)
    assert torch.isfinite(out.per_row[[0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_centre_that_no_list_gathers_is_not_an_error(backend, bank_dtype):
    emb, labels, centres, cl, nb = gathered_case(bank_dtype)
    centres[8] = float("nan")
    ref = nnkloss.neighbour_kernel_loss(emb, labels, gathered_case(bank_dtype)[2], cl, nb,
                                        backend=backend)
    loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, backend=backend)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("where", ["emb", "centres"])
def test_fp32_overflow_nan_row_is_not_an_error_and_propagates(backend, where):
    """Huge but finite values (1e30: the squared distance overflows fp32) give a NaN row by
    rule 6, as a non-finite centre does; the checks tell the two apart (finite inputs: no
    error, with checks on or off) and the NaN reaches the loss."""
    emb, labels, centres, cl, nb = gathered_case(torch.float32)
    if where == "emb":
        emb[2] = 1e30
    else:
        centres[4] = 1e30  # gathered by row 2 only
    for on in (True, False):
        with nnkloss.value_checks(on):
            out = nnkloss.neighbour_kernel_loss_with_stats(emb, labels, centres, cl, nb,
                                                           backend=backend)
        assert torch.isnan(out.per_row[2]) and bool(out.counted[2])
        assert torch.isfinite(out.per_row[[0, 1, 3, 4, 5]]).all()
        assert torch.isnan(out.loss)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_checked_call_takes_no_centre_values_but_in_the_op(backend):
    """With every row finite, no operation but the op itself reads the centres: the checks no
    longer gather the B x K x D values the lists name. Every aten op the call dispatches is
    recorded (TorchDispatchMode); the old pre-op check shows up as an index of the bank by
    the lists (B*K*D values) and fails this test."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    g = torch.Generator().manual_seed(21)
    B, N, D, K = 16, 20, 64, 10
    emb = torch.randn(B, D, generator=g)
    centres = torch.randn(N, D, generator=g)
    labels, cl = torch.randint(0, 3, (B,), generator=g), torch.randint(0, 3, (N,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g)
    bank = centres.untyped_storage().data_ptr()

    class TakesCentres(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []  # the ops that take a tensor on the bank's storage

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == bank
                   for t in tree_leaves((args, kwargs))):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))
    with TakesCentres() as rec:
        loss = nnkloss.neighbour_kernel_loss(emb.requires_grad_(True), labels, centres, cl, nb,
                                             torch.ones(N), backend=backend)
        loss.backward()
    assert torch.isfinite(loss)
    assert rec.seen == ["nnkloss.nk_forward.default"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_on_cpu_tensors_the_op_runs_before_the_gathered_centres_raise(monkeypatch, backend):
    """The order changed on CPU tensors (the index range, emb, sigma and weights are still
    checked before the op; the gathered centres after it, from the rows' losses); the GPU
    order (everything before the op) is kept where validation.defers_gathered_centres says
    no, as it does for CUDA tensors."""
    from nnkloss import validation
    emb, labels, centres, cl, nb = gathered_case()
    centres[4, 0] = float("nan")
    calls = spy_backend_forward(monkeypatch)
    with pytest.raises(ValueError, match=GATHERED_MSG):
        nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, backend=backend)
    assert len(calls) == 1
    bad_nb = nb.clone()
    bad_nb[0, 0] = 9  # out of range: must be refused before any kernel reads it
    with pytest.raises(IndexError, match="index 9"):
        nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, bad_nb, backend=backend)
    assert len(calls) == 1
    assert validation.defers_gathered_centres(torch.device("cpu"))
    assert not validation.defers_gathered_centres(torch.device("cuda"))
    monkeypatch.setattr(validation, "defers_gathered_centres", lambda device: False)
    with pytest.raises(ValueError, match=GATHERED_MSG):
        nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, backend=backend)
    assert len(calls) == 1  # refused before the op, as on a GPU


@pytest.mark.cuda
def test_on_cuda_the_gathered_centres_are_checked_before_the_op(monkeypatch):
    """On a GPU the gathered centres are read before the op, in the one host sync of the value
    checks (a check after the op would be a second sync): the op never runs on them."""
    emb, labels, centres, cl, nb = (t.cuda() for t in gathered_case())
    centres[4, 0] = float("nan")
    calls = spy_backend_forward(monkeypatch)
    with pytest.raises(ValueError, match=GATHERED_MSG):
        nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb)
    assert calls == []
    centres[4, 0] = 1e30  # an fp32 overflow: no error, the NaN propagates
    out = nnkloss.neighbour_kernel_loss_with_stats(emb, labels, centres, cl, nb)
    assert torch.isnan(out.per_row[2]) and torch.isfinite(out.per_row[[0, 1, 3, 4, 5]]).all()


def test_a_float_sigma_is_filled_on_the_device_not_copied_from_the_host(monkeypatch):
    """The functional op's float sigma becomes a 0-dim fp32 tensor by torch.full (a fill on
    the device): torch.tensor(value, device=...) would copy from host memory, and on a GPU
    that copy waits for the stream on every call."""
    from nnkloss import validation
    made = []
    real_full = torch.full
    want = float(torch.tensor(0.7, dtype=torch.float32))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("torch.tensor called"))
    monkeypatch.setattr(torch, "full", lambda *a, **k: made.append(a) or real_full(*a, **k))
    s = validation.check_sigma(0.7, torch.device("cpu"))
    assert made == [((), 0.7)] and s.dtype == torch.float32 and s.shape == ()
    assert float(s) == want


@pytest.mark.cuda
def test_the_functional_op_with_a_float_sigma_never_syncs_on_cuda():
    """Value checks off, a float sigma: forward and backward without a host sync."""
    emb, labels, centres, cl, nb, w = (t.cuda() for t in make_case(6, 30, 8, 5, seed=3))
    x = emb.float().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with nnkloss.value_checks(False):
            loss = nnkloss.neighbour_kernel_loss(x, labels, centres.float(), cl, nb, w.float(),
                                                 sigma=1.3)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss.cpu()) and torch.isfinite(x.grad).all().cpu()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_forward_only_eager_calls_skip_the_custom_op_dispatch(monkeypatch, backend):
    """A forward-only call in eager mode on plain tensors runs without the custom op's
    dispatch (the op's autograd Function carries it): same outputs as through the op. Traced,
    or under a dispatch mode (here fake tensors), the op runs."""
    from nnkloss.ops import neighbour_kernel as nk
    g = torch.Generator().manual_seed(16)
    args = (torch.randn(5, 4, generator=g), torch.tensor([0, 1, 0, 1, 1]),
            torch.randn(7, 4, generator=g), torch.tensor([0, 1, 0, 1, 1, 0, 1]),
            torch.tensor([[0, 1, 2], [2, 3, 4], [4, 1, 0], [5, 6, -1], [6, 3, 1]]),
            torch.rand(7, generator=g) + 0.5, torch.tensor(0.9))
    via_op = []
    real = torch.ops.nnkloss.nk_forward

    def spy(*a):
        via_op.append(a[-2])  # need_grad_x
        return real(*a)
    monkeypatch.setattr(torch.ops.nnkloss, "nk_forward", spy)
    direct = nk.loss_rows_unchecked(*args, backend=backend)
    assert via_op == []
    with torch.no_grad():
        nk.loss_rows_unchecked(args[0].clone().requires_grad_(True), *args[1:], backend=backend)
    assert via_op == []
    monkeypatch.setattr(nk, "plain_eager", lambda *t: False)
    through = nk.loss_rows_unchecked(*args, backend=backend)
    assert via_op == [False]
    assert torch.equal(direct[0], through[0]) and torch.equal(direct[1], through[1])
    nk.loss_rows_unchecked(args[0].clone().requires_grad_(True), *args[1:], backend=backend)
    assert via_op == [False, True]
    monkeypatch.undo()
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert nk.plain_eager(args[0]) and nk.plain_eager(torch.nn.Parameter(args[0]))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        assert not nk.plain_eager(fake[0])
        rows, counted = nk.loss_rows_unchecked(*fake, backend=backend)
        assert rows.shape == (5,) and counted.dtype == torch.bool


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_recorded_eager_calls_run_the_op_as_an_autograd_function(monkeypatch, backend):
    """With a gradient to record, an eager call on plain tensors runs the op's forward,
    setup_context and backward through ``NeighbourKernelFunction`` (no custom-op dispatch); traced, the
    custom op runs. Both carriers give the same loss and the same gradients for emb, centres,
    weights and sigma, bit for bit."""
    from nnkloss.ops import neighbour_kernel as nk
    g = torch.Generator().manual_seed(19)
    emb, centres = torch.randn(6, 5, generator=g), torch.randn(9, 5, generator=g)
    w, s = torch.rand(9, generator=g) + 0.5, torch.tensor(0.8)
    rest = (torch.tensor([0, 1, 0, 1, 2, 2]), torch.tensor([0, 1, 0, 1, 2, 0, 1, 2, 2]),
            torch.tensor([[0, 1, 2], [1, 3, 4], [2, 5, 0], [4, 3, -1], [8, 7, 6], [6, 5, 4]]))
    via_op, via_function = [], []
    real_op, real_apply = torch.ops.nnkloss.nk_forward, nk.NeighbourKernelFunction.apply

    def spy_op(*a):
        via_op.append(a[-2])
        return real_op(*a)

    def spy_apply(*a):
        via_function.append(a[-2])
        return real_apply(*a)
    monkeypatch.setattr(torch.ops.nnkloss, "nk_forward", spy_op)
    monkeypatch.setattr(nk.NeighbourKernelFunction, "apply", spy_apply)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (emb, centres, w, s)]
        x, c, ww, ss = leaves
        loss = nnkloss.neighbour_kernel_loss(x, rest[0], c, rest[1], rest[2], ww, ss,
                                             backend=backend)
        return [loss] + list(torch.autograd.grad(loss, leaves))
    eager = grads()
    assert via_function == [True] and via_op == []
    monkeypatch.setattr(nk, "plain_eager", lambda *t: False)
    traced = grads()
    assert via_function == [True] and via_op == [True]
    for a, b in zip(eager, traced, strict=True):
        assert torch.equal(a, b)
    assert all(t.abs().sum() > 0 for t in eager[1:])
    monkeypatch.undo()
    monkeypatch.setattr(torch.ops.nnkloss, "nk_forward", spy_op)
    monkeypatch.setattr(nk.NeighbourKernelFunction, "apply", spy_apply)

    class Sub(torch.Tensor):  # a tensor subclass among the inputs: the custom op runs
        pass
    via_op.clear()
    via_function.clear()
    x = emb.clone().requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(x, rest[0], centres, rest[1], rest[2],
                                         w.as_subclass(Sub), s, backend=backend)
    assert via_function == [] and via_op and all(via_op)
    loss.backward()
    assert torch.equal(loss.as_subclass(torch.Tensor), eager[0])
    assert torch.equal(x.grad.as_subclass(torch.Tensor), eager[1])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_second_backward_is_an_error_never_a_silent_zero(backend):
    """create_graph=True records the backward (the torch forms run); a second backward through
    it reaches grad_x, for which the op has no formula: an error naming the op."""
    g = torch.Generator().manual_seed(18)
    x = torch.randn(4, 5, generator=g, requires_grad=True)
    loss = nnkloss.neighbour_kernel_loss(
        x, torch.tensor([0, 1, 0, 1]), torch.randn(6, 5, generator=g),
        torch.tensor([0, 1, 0, 1, 1, 0]),
        torch.tensor([[0, 1, 2], [1, 3, 4], [2, 5, 0], [4, 3, -1]]), backend=backend)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="nk_forward has no double-backward"):
        gx.sum().backward()


@pytest.mark.interpreter
def test_entries_past_the_bank_with_checks_off_give_the_cpu_s_nan_rows_on_triton():
    """With the value checks off nothing refuses a list entry >= N: on the Triton backend it
    reads nothing and makes its row NaN (CONTRACT.md 9), as the CPU library does; the whole op
    then gives the CPU's loss, per-row losses and every gradient (NaN where the CPU's is), and
    the weight gradient's scatter stays inside the weights. Before, the kernels read (and the
    centre gradient wrote) past the bank: this very case crashed the process."""
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("no compiled CPU library to compare with")
    emb, labels, centres, cl, nb, w = make_case(6, 20, 8, 5, seed=21, pad=0.1)
    nb[3, 2] = 2**31 - 1
    out = {}
    for backend in ("cpu", "triton"):
        e = emb.float().clone().requires_grad_()
        c = centres.float().clone().requires_grad_()
        ww = w.float().clone().requires_grad_()
        s = torch.tensor(1.1, requires_grad=True)
        with nnkloss.value_checks(False):
            res = nnkloss.neighbour_kernel_loss_with_stats(e, labels, c, cl, nb, ww, s,
                                                           reduction="none", backend=backend)
        res.loss.sum().backward()
        out[backend] = [res.loss.detach(), e.grad, c.grad, ww.grad, s.grad]
    loss = out["triton"][0]
    assert torch.isnan(loss[3]) and torch.isfinite(loss[[0, 1, 2, 4, 5]]).all()
    for a, b in zip(out["triton"], out["cpu"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
