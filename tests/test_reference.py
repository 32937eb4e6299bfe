"""The tests' fp64 reference (tests/reference.py) checked against itself and against calculus.

Its three views must agree (the contract's outputs, the closed-form gradients, the
differentiable loss), and the closed forms of docs/MATHS.md section 3, signs included, must be
the derivatives of the loss: autograd of the differentiable view, and finite differences for the
one-sided derivative at a zero weight.
"""
# Listed in tests/test_layout.py CROSS_CUTTING: it tests tests/reference.py, a helper of the
# tests, not nnkloss/ops/reference.py (whose tests are tests/test_ops_reference.py).
import math

import pytest
import torch

import reference as fp64


def case(seed, B=6, N=11, D=4, K=7, zero_weights=True):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, D, generator=g, dtype=torch.float64)
    centres = torch.randn(N, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 2, (B,), generator=g)
    cl = torch.randint(0, 2, (N,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g)  # duplicates at these sizes
    nb[0, 2:] = -1                                 # padding
    labels[1] = 5                                  # a row without a positive
    w = torch.rand(N, generator=g, dtype=torch.float64) + 0.2
    if zero_weights:
        w[int(nb[2, 0])] = 0.0
    return emb, labels, centres, cl, nb, w, 0.9


@pytest.mark.parametrize("seed", range(4))
def test_views_agree(seed):
    emb, labels, centres, cl, nb, w, sigma = case(seed)
    out = fp64.forward(emb, labels, centres, cl, nb, w, sigma)
    grads = fp64.gradients(emb, labels, centres, cl, nb, w, sigma)
    rows, counted = fp64.reference_loss_rows(emb, labels, centres, cl, nb, w, sigma)
    assert not bool(counted[1]) and rows[1] == 0 and out.lse_pos[1] == -math.inf
    assert torch.equal(counted, grads.counted)
    assert torch.equal(counted, out.lse_pos != -math.inf)
    torch.testing.assert_close(out.loss, grads.rows, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(rows, grads.rows, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(out.grad_x, grads.grads["emb"], rtol=1e-14, atol=1e-14)
    u = ((centres[nb.clamp_min(0)] - emb[:, None]) ** 2).sum(-1) / sigma ** 2
    torch.testing.assert_close(out.dist, u.masked_fill(nb < 0, 0.0))


@pytest.mark.parametrize("seed", range(4))
def test_closed_forms_are_the_derivatives(seed):
    """dL/dx, dL/dc_j, dL/dw_j and dL/dsigma as docs/MATHS.md writes them, against autograd of
    the loss (weights away from 0, where the loss is differentiable)."""
    emb, labels, centres, cl, nb, w, sigma = case(seed, zero_weights=False)
    closed = fp64.gradients(emb, labels, centres, cl, nb, w, sigma).grads
    inputs = [t.clone().requires_grad_(True)
              for t in (emb, centres, w, torch.tensor(sigma, dtype=torch.float64))]
    rows, _ = fp64.reference_loss_rows(inputs[0], labels, inputs[1], cl, nb, inputs[2],
                                       inputs[3])
    auto = torch.autograd.grad(rows.sum(), inputs)
    for name, a in zip(("emb", "centres", "weights", "sigma"), auto, strict=True):
        assert a.abs().max() > 1e-3, name  # something to compare
        torch.testing.assert_close(closed[name], a, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_sign_of_the_pull():
    """One same-class centre and one other: descending the loss pulls x towards its own class's
    centre and pulls that centre towards x (docs/MATHS.md section 3)."""
    emb = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    centres = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    g = fp64.gradients(emb, torch.tensor([0]), centres, torch.tensor([0, 1]),
                       torch.tensor([[0, 1]]), None, 1.0).grads
    step = -g["emb"][0]                          # gradient descent on x
    assert step @ (centres[0] - emb[0]) > 0 and step @ (centres[1] - emb[0]) < 0
    assert -g["centres"][0] @ (emb[0] - centres[0]) > 0
    assert g["weights"][0] < 0 < g["weights"][1]  # more weight on the positive lowers the loss


def test_zero_weight_gradient_is_the_one_sided_derivative():
    emb, labels, centres, cl, nb, w, sigma = case(7, zero_weights=False)
    # A centre whose removal leaves every row's counting unchanged: the loss is then
    # differentiable from the right at w_j = 0.
    for j in nb[nb >= 0].unique().tolist():
        removed = w.clone()
        removed[j] = 0.0
        if torch.equal(fp64.reference_loss_rows(emb, labels, centres, cl, nb, removed, sigma)[1],
                       fp64.reference_loss_rows(emb, labels, centres, cl, nb, w, sigma)[1]):
            break
    else:
        raise AssertionError("test data has no suitable centre")
    w = removed
    closed = fp64.gradients(emb, labels, centres, cl, nb, w, sigma).grads["weights"][j]
    eps = 1e-7
    w_eps = w.clone()
    w_eps[j] = eps
    fd = (fp64.reference_loss(emb, labels, centres, cl, nb, w_eps, sigma, reduction="sum")
          - fp64.reference_loss(emb, labels, centres, cl, nb, w, sigma, reduction="sum")) / eps
    assert closed != 0
    torch.testing.assert_close(closed, fd, rtol=1e-5, atol=1e-9)


def test_non_finite_rows_and_fp32_overflow():
    emb, labels, centres, cl, nb, w, sigma = case(3, zero_weights=False)
    emb[2, 0] = math.nan
    out = fp64.forward(emb, labels, centres, cl, nb, w, sigma)
    grads = fp64.gradients(emb, labels, centres, cl, nb, w, sigma)
    assert math.isnan(out.loss[2]) and torch.isnan(out.grad_x[2]).all()
    assert math.isnan(grads.rows[2]) and bool(grads.counted[2])
    assert torch.isfinite(out.loss[[0, 3, 4, 5]]).all()
    # |x| ~ 1e20 with sigma 1: u overflows fp32 (the row is NaN), not fp64.
    big = torch.tensor([[1e20, 1e20]])
    args = (torch.tensor([0]), torch.tensor([[0.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]),
            torch.tensor([[0, 1]]), None, 1.0)
    assert math.isnan(fp64.forward(big, *args).loss[0])
    assert math.isfinite(fp64.forward(big.double(), *args).loss[0])


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_loss_op.py (now tests/test_ops_neighbour_kernel.py) in issue 19.
from cases import make_case  # noqa: E402
from reference import reference_loss  # noqa: E402


def test_gradcheck_reference():
    emb, labels, centres, cl, nb, w = make_case(4, 9, 3, 5, seed=12, pad=0.2)
    s = torch.tensor(1.1, dtype=torch.float64)
    args = [t.requires_grad_(True) for t in (emb, centres, w, s)]
    assert torch.autograd.gradcheck(
        lambda e, c, ww, ss: reference_loss(e, labels, c, cl, nb, ww, ss), args)
