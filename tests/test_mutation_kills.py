"""Tests written for mutants that survived the mutation check of the core (issue 14,
tests/MUTATION.md, "Run on the final core"). Each one asserts a promised behaviour that no
test checked before; the comment names the mutants it kills."""
import pytest
import torch

import nnkloss


# ----------------------------------------------------------------------- nnkloss.ops.reference
def test_empty_bank_with_trainable_centres():
    """N = 0 with centres and sigma that require grad: empty / zero gradients, no crash
    (kills reference.centre_grad 14: the early return on an empty bank tested shape[1])."""
    emb = torch.randn(3, 4, requires_grad=True)
    centres = torch.empty(0, 4, requires_grad=True)
    sigma = torch.tensor(1.0, requires_grad=True)
    out = nnkloss.neighbour_kernel_loss_with_stats(
        emb, torch.tensor([0, 1, 0]), centres, torch.empty(0, dtype=torch.long),
        torch.full((3, 2), -1), None, sigma, backend="torch")
    assert float(out.loss.detach()) == 0.0
    ge, gc, gs = torch.autograd.grad(out.loss, [emb, centres, sigma])
    assert torch.equal(ge, torch.zeros(3, 4))
    assert gc.shape == (0, 4)
    assert float(gs.detach()) == 0.0


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


def test_nonfinite_row_reaches_the_gradient_of_a_one_centre_bank():
    """A NaN embedding row makes the centre gradient NaN ("never silent"), also when the bank
    holds a single centre (where every finite row has p = p^R and contributes exactly 0).
    Kills reference.centre_grad 16 (a one-centre bank returned a zero gradient)."""
    emb = torch.tensor([[0.5, -1.0], [float("nan"), 0.0]], requires_grad=True)
    centres = torch.tensor([[1.0, 2.0]], requires_grad=True)
    with nnkloss.value_checks(False):
        out = nnkloss.neighbour_kernel_loss_with_stats(
            emb, torch.tensor([3, 3]), centres, torch.tensor([3]), torch.tensor([[0, 0], [0, -1]]),
            backend="torch")
    assert torch.isnan(out.loss)
    (gc,) = torch.autograd.grad(out.loss, [centres], retain_graph=True)
    assert torch.isnan(gc).all()
    # The finite row alone: loss 0 and a zero (not NaN) centre gradient.
    (gc0,) = torch.autograd.grad(out.per_row[0], [centres])
    assert torch.equal(gc0, torch.zeros(1, 2))
