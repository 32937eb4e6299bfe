"""kernels/entry_grads.py: the backward's per-entry terms (centre, weight and sigma gradients)
as a Triton kernel, against the torch form of the op's backward (Triton's interpreter on CPU
tensors), through the op and called directly."""
import pytest
import torch

import nnkloss
from cases import centre_weight_sigma_grads, check_entry_terms_of_nan_rows, list_case
from nnkloss.ops import neighbour_kernel as ops_nk

pytestmark = pytest.mark.interpreter


def _kernels():
    return nnkloss.ops.backends.kernels()


def grads(backend, case, dtype, row_grad=None):
    """Loss and gradients of emb, centres, weights and sigma: a mean, or per-row gradients."""
    return centre_weight_sigma_grads(backend, *case, dtype, row_grad=row_grad,
                                     reduction="mean" if row_grad is None else "none")


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
    case = list_case(K=K, N=40, seed=K, idx_dtype=idx_dtype, cl_dtype=cl_dtype)
    row_grad = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0, 3.0, 1.0, 1.0])
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-13)
    for rg in (None, row_grad):
        spy.clear()
        got = grads("triton", case, dtype, rg)
        assert spy == [(True, True, True)]
        want = grads("torch", case, dtype, rg)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **tol)
        if K > 1:  # the zero weight's one-sided derivative (alone in its list at K 1: no row)
            assert got[3][case[5] == 0].abs().sum() > 0


def test_nan_rows_and_rows_that_take_no_gradient(spy):
    check_entry_terms_of_nan_rows("triton")
    assert len(spy) == 2


def test_only_the_asked_terms_and_no_weights(spy):
    """Each gradient alone (the others' outputs are not written), and a call without
    weights (no q)."""
    emb, labels, centres, cl, nb, w, s = list_case(N=40, seed=5)
    s = float(s)
    k = _kernels()
    B, K = nb.shape
    with torch.no_grad(), nnkloss.value_checks(False):
        loss, lse_all, lse_pos, _, u, *_ = ops_nk._forward(
            emb, labels, centres, cl, nb, w, torch.tensor(s), "torch", True, False, False)
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


def test_entries_past_the_bank_read_no_weight_or_label():
    """Rule 9: an entry >= N (the value checks off) reads nothing. The weight terms read the
    weight and label of bank row 0 in its place: out of an empty bank's (N 0) tensors, a
    segmentation fault in the interpreter (an illegal address on a GPU)."""
    k = _kernels()
    nan, inf = float("nan"), float("inf")
    u = torch.tensor([[nan, 0.0], [0.0, 0.0]])  # the forward's u: NaN past the bank
    labels = torch.tensor([0, 1])
    nb = torch.tensor([[0, -1], [-1, -1]])
    lse = torch.tensor([nan, -inf])  # row 0 non-finite, row 1 all padding
    coef, q, srow = k.entry_grads(u, labels, torch.empty(0, dtype=torch.int64), nb,
                                  torch.empty(0), lse, lse, torch.ones(2), torch.tensor(1.0),
                                  True, True, True)
    assert torch.isnan(q[0, 0]) and (q[0, 1] == 0) and (q[1] == 0).all()
    assert torch.isnan(coef[0]).all() and (coef[1] == 0).all()
    assert torch.isnan(srow[0]) and srow[1] == 0


def test_a_recorded_backward_runs_the_torch_form(spy):
    """create_graph=True: the torch form (differentiable), not the kernel; same first
    derivatives."""
    case = list_case(B=5, K=4, D=6, N=20, seed=4)
    got = centre_weight_sigma_grads("triton", *case, torch.float64, create_graph=True)
    assert spy == [] and got[4].requires_grad
    want = centre_weight_sigma_grads("triton", *case, torch.float64)
    assert len(spy) == 1
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-14)
