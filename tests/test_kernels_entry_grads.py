"""kernels/entry_grads.py: the backward's per-entry terms (centre, weight and sigma gradients)
as a Triton kernel, against the torch form of the op's backward (Triton's interpreter on CPU
tensors), through the op and called directly."""
import pytest
import torch

import nnkloss
from nnkloss.ops import neighbour_kernel as ops_nk

pytestmark = pytest.mark.interpreter


def _kernels():
    return nnkloss.ops.backends.kernels()


def make(B=9, K=7, D=13, N=40, idx_dtype=torch.int64, cl_dtype=torch.int64, seed=0, classes=3):
    """Rows of padding, duplicates, no positive, a zero weight (as tests/test_cpu_kernel.py)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g)
    cl = torch.randint(0, classes, (N,), generator=g).to(cl_dtype)
    nb = torch.randint(0, N, (B, K), generator=g)
    nb[0, 1:] = -1                          # mostly padding
    nb[1, :] = nb[1, 0]                     # duplicates
    labels = torch.randint(0, classes, (B,), generator=g)
    labels[2] = classes + 5                 # no positive
    emb = centres[nb[:, 0].clamp_min(0)] + 0.5 * torch.randn(B, D, generator=g)
    w = torch.rand(N, generator=g) + 0.1
    w[nb[3, 0]] = 0.0                       # a zero weight
    return emb, labels, centres, cl, nb.to(idx_dtype), w, 1.7


def grads(backend, emb, labels, centres, cl, nb, w, sigma, dtype, row_grad=None,
          create_graph=False):
    """The loss and the gradients of emb, centres, weights and sigma on ``backend``."""
    x = emb.to(dtype).clone().requires_grad_(True)
    c = centres.to(dtype).clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    ss = torch.tensor(float(sigma), dtype=dtype, requires_grad=True)
    with nnkloss.value_checks(False):
        out = nnkloss.neighbour_kernel_loss(x, labels, c, cl, nb, ww, ss,
                                            reduction="mean" if row_grad is None else "none",
                                            backend=backend)
    target = out if row_grad is None else (out * row_grad.to(out.dtype)).sum()
    return [out] + list(torch.autograd.grad(target, [x, c, ww, ss], create_graph=create_graph))


@pytest.fixture
def spy(monkeypatch):
    kernels = _kernels()
    calls = []
    real = kernels.entry_grads
    monkeypatch.setattr(kernels, "entry_grads",
                        lambda *a: calls.append(a[-3:]) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("idx_dtype,cl_dtype", [(torch.int32, torch.int64),
                                                (torch.int64, torch.int32)])
@pytest.mark.parametrize("K", [1, 6, 700])
def test_entry_terms_match_the_torch_form(spy, dtype, idx_dtype, cl_dtype, K):
    """The op's centre, weight and sigma gradients on the Triton backend come from the kernel
    (spied) and match the torch backend's, for a mean's expanded gradient and for per-row
    gradients with zeros; K 700 is two tiles of the list."""
    case = make(K=K, seed=K, idx_dtype=idx_dtype, cl_dtype=cl_dtype)
    row_grad = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0, 3.0, 1.0, 1.0])
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-13)
    for rg in (None, row_grad):
        spy.clear()
        got = grads("triton", *case, dtype, row_grad=rg)
        assert spy == [(True, True, True)]
        want = grads("torch", *case, dtype, row_grad=rg)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **tol)
        if K > 1:  # the zero weight's one-sided derivative (alone in its list at K 1: no row)
            assert got[3][case[5] == 0].abs().sum() > 0


def test_nan_rows_and_rows_that_take_no_gradient(spy):
    """A row that gathers an inf centre is NaN (checks off): NaN to sigma, to its entries'
    weights and to the centres it gathers, as the torch form; with an incoming gradient of 0
    it passes nothing, NaN or not."""
    emb, labels, centres, cl, nb, w, s = make(B=6, K=5, D=7, N=30, seed=3)
    centres = centres.clone()
    centres[nb[4, 2]] = float("inf")
    for row_grad in (torch.ones(6), torch.tensor([1.0, 1, 1, 1, 0, 1])):
        got = grads("triton", emb, labels, centres, cl, nb, w, s, torch.float32,
                    row_grad=row_grad)
        want = grads("torch", emb, labels, centres, cl, nb, w, s, torch.float32,
                     row_grad=row_grad)
        for a, b in zip(got[2:], want[2:], strict=True):
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)
        if row_grad[4] == 0:
            assert torch.isfinite(got[3]).all() and torch.isfinite(got[4])
        else:
            assert torch.isnan(got[4]) and torch.isnan(got[3][nb[4]]).all()
    assert len(spy) == 2


def test_only_the_asked_terms_and_no_weights(spy):
    """Each gradient alone (the others' outputs are not written), and a call without
    weights (no q)."""
    emb, labels, centres, cl, nb, w, s = make(seed=5)
    k = _kernels()
    B, K = nb.shape
    with torch.no_grad(), nnkloss.value_checks(False):
        loss, lse_all, lse_pos, _, u = ops_nk._forward(
            emb, labels, centres, cl, nb, w, torch.tensor(s), "torch", True, False)
    g = torch.full((), 0.5).expand(B)
    full = k.entry_grads(u, labels, cl, nb, w, lse_all, lse_pos, g, torch.tensor(s),
                         True, True, True)
    for i, need in enumerate(((True, False, False), (False, True, False), (False, False, True))):
        out = k.entry_grads(u, labels, cl, nb, w, lse_all, lse_pos, g, torch.tensor(s), *need)
        assert [t is not None for t in out] == list(need)
        torch.testing.assert_close(out[i], full[i], rtol=0, atol=0)
    coef, q, srow = k.entry_grads(u, labels, cl, nb, None, lse_all, lse_pos, g,
                                  torch.tensor(s), True, True, True)
    assert q is None and coef.shape == (B, K) and srow.shape == (B,)
    empty = k.entry_grads(u[:0], labels[:0], cl, nb[:0], w, lse_all[:0], lse_pos[:0], g[:0],
                          torch.tensor(s), True, True, True)
    assert [t.shape for t in empty] == [(0, K), (0, K), (0,)]


def test_a_recorded_backward_runs_the_torch_form(spy):
    """create_graph=True: the torch form (differentiable), not the kernel; same first
    derivatives."""
    case = make(B=5, K=4, D=6, N=20, seed=4)
    got = grads("triton", *case, torch.float64, create_graph=True)
    assert spy == [] and got[4].requires_grad
    want = grads("triton", *case, torch.float64)
    assert len(spy) == 1
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-14)
