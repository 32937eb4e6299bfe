"""nnkloss/ops/reference.py: the plain chunked PyTorch implementation of the op (backend="torch").

Its forward against nnkloss/ops/CONTRACT.md (output dtypes and shapes, rows without a positive,
padding distances, stored distances), its bounded chunks, its centre gradient on empty and
one-centre banks. (tests/test_reference.py checks the tests' own fp64 reference,
tests/reference.py, not this module.)
"""
import pytest
import torch

import nnkloss
from nnkloss.ops import reference as torch_path
from cases import compare, make_case


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
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


def test_reference_forward_stores_distances_by_default():
    """Kills ops.reference forward 1 (``store_dist=False`` as the default: the contract's
    default is to return the (B, K) scaled distances)."""
    from nnkloss.ops import reference
    g = torch.Generator().manual_seed(8)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    args = (emb, torch.tensor([0, 1, 0]), centres, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, -1]]), None, torch.tensor(1.5))
    dist = reference.forward(*args)[4]
    assert dist.shape == (3, 2)
    torch.testing.assert_close(dist, reference.forward(*args, store_dist=True)[4])
    torch.testing.assert_close(dist[0, 0], ((centres[0] - emb[0]) / 1.5).pow(2).sum())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp64_embeddings_take_an_fp32_sigma_exactly(backend):
    """Kills ops.reference forward 10 (``1 / sigma`` taken in sigma's fp32 instead of the fp64
    compute dtype): fp64 results must carry no fp32 rounding. A float sigma becomes an fp32
    tensor (validation.check_sigma), so this is the everyday fp64 case."""
    g = torch.Generator().manual_seed(9)
    emb = torch.randn(5, 6, generator=g, dtype=torch.float64)
    centres = torch.randn(8, 6, generator=g, dtype=torch.float64)
    # bank dtype must be one the op accepts with fp64 embeddings: fp32 centres, exact in fp64
    centres = centres.float()
    labels, cl = torch.tensor([0, 1, 0, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    nb = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 3, 5], [2, 4, 6]])
    sigma32 = torch.tensor(0.3)                          # 0.30000001192092896
    out = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, sigma=sigma32,
                                        reduction="none", backend=backend)
    s = float(sigma32)
    rows = []
    for b in range(5):
        u = ((centres[nb[b]].double() - emb[b]) / s).pow(2).sum(-1)
        pos = cl[nb[b]] == labels[b]
        rows.append(torch.logsumexp(-u / 2, 0) - torch.logsumexp((-u / 2)[pos], 0))
    torch.testing.assert_close(out, torch.stack(rows), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_contract_no_positive_row_and_padding_distances(backend):
    """CONTRACT.md 5 and 7, read directly from the forward (the op's backward masks rows whose
    upstream gradient is 0, so a NaN there never reached a test through the op). Kills
    ops.reference row_softmax 37 (an empty softmax's 0/0 made grad_x NaN for a row without a
    positive) and forward 62 (padding distances stored as 1)."""
    from nnkloss.ops import backends
    impl = backends.by_name(backend)
    g = torch.Generator().manual_seed(10)
    emb, centres = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    loss, lse_all, lse_pos, grad_x, dist = impl.forward(
        emb, torch.tensor([0, 1, 7]), centres, torch.tensor([0, 1, 0, 1, 1]),
        torch.tensor([[0, 1], [2, 3], [4, -1]]), None, torch.tensor(1.3))
    assert loss[2] == 0 and lse_pos[2] == -float("inf") and torch.isfinite(lse_all[2])
    assert torch.equal(grad_x[2], torch.zeros(4))
    assert dist[2, 1] == 0 and dist[2, 0] > 0


def test_reference_path_gathers_in_bounded_chunks(monkeypatch):
    """The plain path never builds the whole (B, K, D) gather: rows go through in chunks of
    rows_per_chunk(K, D). Kills ops.reference forward 34 (step dropped: overlapping one-row
    steps) and 36 (each chunk running to the end of the batch)."""
    from nnkloss.ops import reference
    monkeypatch.setattr(reference, "CHUNK_ELEMS", 2 * 3 * 4)     # two rows of K=3, D=4
    sizes = []
    real = reference.row_terms

    def spy(nbr, *args):
        sizes.append(nbr.shape[0])
        return real(nbr, *args)
    monkeypatch.setattr(reference, "row_terms", spy)
    g = torch.Generator().manual_seed(11)
    emb, centres = torch.randn(5, 4, generator=g), torch.randn(6, 4, generator=g)
    nb = torch.randint(0, 6, (5, 3), generator=g)
    labels, cl = torch.tensor([0, 1, 0, 1, 0]), torch.tensor([0, 1, 0, 1, 0, 1])
    out = reference.forward(emb, labels, centres, cl, nb, None, torch.tensor(1.0))
    assert sizes == [2, 2, 1]
    monkeypatch.setattr(reference, "CHUNK_ELEMS", 1 << 22)
    for a, b in zip(out, reference.forward(emb, labels, centres, cl, nb, None,
                                           torch.tensor(1.0)), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("emb_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_forward_outputs_are_in_the_compute_dtype(backend, emb_dtype):
    """CONTRACT.md: all five outputs in the compute dtype (fp32 for half embeddings), dist
    (B, 0) without store_dist. Kills ops.reference empty_outputs 9, 11, 13, 15 (lse buffers in
    the embedding's half dtype) and 29, 30 (dist (B, K) or (B, 1) without store_dist)."""
    from nnkloss.ops import backends
    impl = backends.by_name(backend)
    g = torch.Generator().manual_seed(14)
    emb = torch.randn(3, 4, generator=g).to(emb_dtype)
    centres = torch.randn(5, 4, generator=g)
    args = (emb, torch.tensor([0, 1, 0]), centres, torch.tensor([0, 1, 0, 1, 1]),
            torch.tensor([[0, 1], [2, 3], [4, 1]]), None, torch.tensor(1.1))
    cdt = torch.float64 if emb_dtype == torch.float64 else torch.float32
    for store, k in ((True, 2), (False, 0)):
        out = impl.forward(*args, store_dist=store)
        assert [t.dtype for t in out] == [cdt] * 5
        assert [tuple(t.shape) for t in out] == [(3,), (3,), (3,), (3, 4), (3, k)]


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_loss_op.py (now tests/test_ops_neighbour_kernel.py) in issue 19.
def test_torch_path_chunks_agree(monkeypatch):
    """Forcing many small chunks changes nothing (the (rows, K, D) temporary is bounded)."""
    case = make_case(9, 20, 6, 5, seed=14, pad=0.2)
    full = compare(case, "torch", torch.float64, torch.float64)
    monkeypatch.setattr(torch_path, "CHUNK_ELEMS", 31)
    assert torch_path.rows_per_chunk(5, 6) == 1
    chunked = compare(case, "torch", torch.float64, torch.float64)
    torch.testing.assert_close(full.per_row, chunked.per_row)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_padding_reads_nothing_into_the_embedding_gradient(backend, bad):
    """CONTRACT.md 1 and 5: padding is not an entry, so a non-finite bank row that no list
    names (a slot not filled yet) cannot reach a finite row, with the value checks on (they
    read only the listed rows). The torch path gathered row 0 for padding and multiplied it by
    the padding's zero coefficient in grad_x: 0 * NaN made the emb gradient NaN while the loss
    stayed finite."""
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(3, 4, generator=g, requires_grad=True)
    centres = torch.randn(4, 4, generator=g)
    labels, cl = torch.tensor([1, 1, 0]), torch.tensor([0, 1, 0, 1])
    nb = torch.tensor([[1, 2, -1], [3, -1, -1], [2, 1, 3]])  # row 0 is never listed
    grads = []
    for row0 in (centres[0].clone(), torch.full((4,), bad)):
        c = centres.clone()
        c[0] = row0
        loss = nnkloss.neighbour_kernel_loss(emb, labels, c, cl, nb, sigma=0.7,
                                             backend=backend)
        assert torch.isfinite(loss)
        (ge,) = torch.autograd.grad(loss, [emb])
        grads.append(ge)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
