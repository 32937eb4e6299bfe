"""The op's passes on the CPU library (nnkloss/cpu/op.py) against an fp64 computation of
nnkloss/ops/CONTRACT.md.

The reference is the tests' fp64 one (tests/reference.py ``forward``), row by row from the
values the kernel actually receives (emb converted to the compute dtype; bank values are exact
in fp32).
"""
import math
import warnings

import pytest
import torch

from nnkloss import cpu
from nnkloss.cpu import build
from cases import (centre_weight_sigma_grads, check_entry_terms_of_nan_rows, check_rel_sqdist,
                   list_case, rel_sqdist_fp64)
from reference import forward as reference

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback tests below check the notice
    kernel = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: fallback only")

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INDEX = [torch.int32, torch.int64]


def check(out, ref, cdt, dist_too=True):
    loss, lse_all, lse_pos, grad_x, dist = out
    rl, ra, rp, rg, rd, scale = ref
    assert all(t.dtype == cdt for t in out)
    rtol = 1e-4 if cdt == torch.float32 else 1e-10
    # loss = lse_all - lse_pos: rounding of u (relative eps of the compute dtype) cancels into
    # it in absolute terms, whatever the implementation
    big = ra[torch.isfinite(ra)].abs().max().item() if torch.isfinite(ra).any() else 0.0
    atol = rtol + (1e-6 if cdt == torch.float32 else 1e-14) * big
    for got, want in ((loss, rl), (lse_all, ra), (lse_pos, rp)):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, equal_nan=True)
    atol = rtol * (scale.max().item() + 1e-30)
    torch.testing.assert_close(grad_x.double(), rg, rtol=rtol, atol=atol, equal_nan=True)
    if dist_too:
        torch.testing.assert_close(dist.double(), rd, rtol=rtol, atol=0, equal_nan=True)


make = list_case  # tests/cases.py


@kernel
@pytest.mark.parametrize("emb_dtype", FLOATS)
@pytest.mark.parametrize("bank_dtype", FLOATS)
@pytest.mark.parametrize("idx_dtype,cl_dtype", [(torch.int32, torch.int64),
                                                (torch.int64, torch.int32),
                                                (torch.int64, torch.int64)])
@pytest.mark.parametrize("D", [13, 64, 128, 256])
def test_forward_matches_fp64_contract(emb_dtype, bank_dtype, idx_dtype, cl_dtype, D):
    """Every dtype pair and index width; D 64, 128 and 256 take the one-row-at-a-time pass
    at a compile-time D for fp32 / bf16 banks (row_distances_fixed), D 13 the groups of
    four. The labels in the centre labels' integer type: the kernel reads int32 and int64
    labels as they are."""
    inputs = make(emb_dtype=emb_dtype, bank_dtype=bank_dtype, idx_dtype=idx_dtype,
                  cl_dtype=cl_dtype, D=D)
    inputs = (inputs[0], inputs[1].to(cl_dtype)) + inputs[2:]
    cdt = torch.float64 if emb_dtype == torch.float64 else torch.float32
    check(cpu.forward(*inputs), reference(*inputs), cdt)


@kernel
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("sigma,offset", [(0.05, 0.0), (1.0, 30.0), (40.0, 0.0), (1.0, 1e3)])
@pytest.mark.parametrize("D,bank_dtype", [(24, torch.float32), (128, torch.float32),
                                          (256, torch.bfloat16)])
def test_forward_scales(weights, sigma, offset, D, bank_dtype):
    """Near and far embeddings, narrow and wide kernels: values and grad_x against fp64, on
    the groups of four (D 24) and on the one-at-a-time pass (D 128 fp32, D 256 bf16), whose
    forward-only call gives the same bits."""
    emb, labels, centres, cl, nb, w, _ = make(B=12, K=16, D=D, N=40, weights=weights, seed=3,
                                              bank_dtype=bank_dtype)
    emb = emb + offset  # far from every centre: the log-sum-exps must stay exact
    inputs = (emb, labels, centres, cl, nb, w, torch.tensor(sigma))
    full = cpu.forward(*inputs)
    check(full, reference(*inputs), torch.float32)
    fwd = cpu.forward(*inputs, need_grad_x=False)
    for a, b in zip(full[:3] + full[4:], fwd[:3] + fwd[4:]):
        assert torch.equal(a, b)


@kernel
@pytest.mark.parametrize("bank_dtype", FLOATS)
def test_wide_rows(bank_dtype):
    # D 600: past the largest of the second pass's column blocks (256), with a ragged tail
    inputs = make(B=5, K=6, D=600, N=30, bank_dtype=bank_dtype, seed=13)
    check(cpu.forward(*inputs), reference(*inputs), torch.float32)
    emb, _, centres, _, nb, _, _ = inputs
    coef = torch.randn(5, 6)
    want = torch.zeros(30, 600, dtype=torch.float64)
    for b in range(5):
        for k in range(6):
            if nb[b, k] >= 0:
                want[nb[b, k]] += coef[b, k].double() * (emb[b].double()
                                                         - centres[nb[b, k]].double())
    torch.testing.assert_close(cpu.centre_grad(emb, centres, nb, coef).double(), want,
                               rtol=1e-5, atol=1e-5)


@kernel
@pytest.mark.parametrize("weights", ["none", "fp32", "fp64", "odd"])
@pytest.mark.parametrize("idx_dtype,cl_dtype", [(torch.int32, torch.int32),
                                                (torch.int64, torch.int64),
                                                (torch.int32, torch.int64)])
def test_logits_over_several_blocks_of_entries(weights, idx_dtype, cl_dtype):
    """The logits are taken 64 entries at a time (list_logits_of's gathered weights and
    labels): lists of 1, 63, 64, 65 and 200 entries with padding, entries past the bank and
    zero, non-unit and uniform weights in every block give the fp64 contract's values, and a
    row whose entry past the bank sits in its last block comes out NaN."""
    for K in (1, 63, 64, 65, 200):
        emb, labels, centres, cl, nb, _, s = make(B=6, K=K, D=8, N=300, idx_dtype=idx_dtype,
                                                  cl_dtype=cl_dtype, seed=K)
        g = torch.Generator().manual_seed(K)
        w = None
        if weights != "none":
            w = torch.ones(300, dtype=torch.float64 if weights == "fp64" else torch.float32)
            if weights == "odd":  # zero and non-unit weights scattered over the blocks
                w = torch.rand(300, generator=g) + 0.5
                w[nb[3].clamp_min(0)[::7]] = 0.0
        nb = nb.clone()
        nb[4, ::5] = -1  # padding in every block
        check(cpu.forward(emb, labels, centres, cl, nb, w, s),
              reference(emb, labels, centres, cl, nb, w, s), torch.float32)
        nb[5, K - 1] = 300  # past the bank, in the last block: the row is NaN, the others not
        out = cpu.forward(emb, labels, centres, cl, nb, w, s)
        assert out[0][5].isnan() and not out[0][:5].isnan().any(), K


@kernel
def test_a_label_the_centre_labels_cannot_hold_matches_no_centre():
    """int64 row labels against int32 centre labels: a label past int32's range has no
    positive, though its low 32 bits equal a centre's label (the kernel compares in the centre
    labels' type only where the label fits it)."""
    emb, labels, centres, cl, nb, _, s = make(B=6, K=70, D=8, N=30, cl_dtype=torch.int32,
                                              seed=2)
    cl = torch.full_like(cl, 5)
    wide = labels.clone()
    wide[:] = 5
    wide[1] = 2 ** 32 + 5  # 5 in its low 32 bits
    # Unit weights: the SIMD pass decides every entry (non-unit ones are taken again one at
    # a time, with the labels compared as int64).
    for w in (None, torch.ones(30), torch.ones(30, dtype=torch.float64)):
        out = cpu.forward(emb, wide, centres, cl, nb, w, s)
        assert out[2][1] == float("-inf") and out[0][1] == 0.0  # no positive: loss 0
        assert (out[2][[0, 2, 3, 4, 5]] > float("-inf")).all()
        check(out, reference(emb, wide, centres, cl, nb, w, s), torch.float32)


@kernel
def test_k1_and_all_positive_rows():
    emb, labels, centres, cl, nb, w, s = make(B=6, K=1, N=10, weights=False, seed=4)
    check(cpu.forward(emb, labels, centres, cl, nb, w, s),
          reference(emb, labels, centres, cl, nb, w, s), torch.float32)
    # a single class: p = p^R, loss 0, gradient 0 exactly
    cl1 = torch.zeros_like(cl)
    lab1 = torch.zeros_like(labels)
    nb8 = torch.randint(0, 10, (6, 8))
    out = cpu.forward(emb, lab1, centres, cl1, nb8, None, s)
    assert torch.equal(out[0], torch.zeros(6)) and torch.equal(out[3], torch.zeros(6, 13))


# Gathered sets (K x D x element bytes per row) beyond the kernel's NNK_ONE_PASS_BYTES (512 KiB;
# NNK_ONE_PASS_PREFETCHED_BYTES, 128 KiB, for fp32 rows of 4 KiB or more): a forward with
# grad_x reads the rows once, folding them into running sums (csrc/op.cpp).
# (torch.float32, 1100, 128) and (torch.bfloat16, 1100, 256): with grad_x these rows go through
# groups of four at a runtime D, without it one at a time at a compile-time D
# (row_distances_fixed): the forward-only call must still give the same bits. The last: fp32
# rows of at least NNK_FOLD_PREFETCH_MIN_ROW_BYTES (4 KiB), whose groups leave two rows'
# prefetching to the fold (the loop's own branch), with a ragged end (1100 = 68 x 16 + 12),
# in a set of 176 KiB: one pass from NNK_ONE_PASS_PREFETCHED_BYTES on.
ONE_PASS = [(torch.float32, 140, 1000), (torch.float64, 80, 900), (torch.bfloat16, 160, 1700),
            (torch.float16, 160, 1700), (torch.float32, 1100, 128), (torch.bfloat16, 1100, 256),
            (torch.float32, 40, 1100)]


@kernel
@pytest.mark.parametrize("bank_dtype,K,D", ONE_PASS)
@pytest.mark.parametrize("weights", [False, True])
def test_one_pass_gradient_matches_fp64(bank_dtype, K, D, weights):
    """The single-pass gradient (online rescaled sums) against the fp64 contract: padding,
    duplicates, a row without positives and a zero weight (make), embeddings nearer and farther
    (lists in random order: the running maximum rises and the sums are rescaled), the loss and
    log-sum-exps bit for bit those of the forward-only call (CONTRACT.md 8). (Far larger
    offsets put the logits where fp32 spacing itself moves p by percents, on either path.)"""
    for offset in (0.0, 1.0):
        emb, labels, centres, cl, nb, w, s = make(B=7, K=K, D=D, N=60, bank_dtype=bank_dtype,
                                                  weights=weights, seed=41)
        inputs = (emb + offset, labels, centres, cl, nb, w, s)
        full = cpu.forward(*inputs)
        check(full, reference(*inputs), torch.float32)
        fwd = cpu.forward(*inputs, need_grad_x=False)
        for a, b in zip(full[:3] + full[4:], fwd[:3] + fwd[4:]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@kernel
@pytest.mark.parametrize("bank_dtype,K,D", [(torch.float32, 700, 64), (torch.bfloat16, 1100, 70),
                                            (torch.float64, 300, 60)])
def test_short_rows_of_a_large_set_take_two_passes_and_match_fp64(bank_dtype, K, D):
    """Gathered sets beyond ONE_PASS_BYTES whose rows are shorter than
    NNK_ONE_PASS_MIN_ROW_BYTES: the two-pass gradient, at K in the hundreds to a thousand
    (the Fashion-MNIST lists), against the fp64 contract, with the forward-only bits."""
    emb, labels, centres, cl, nb, w, s = make(B=5, K=K, D=D, N=2000, bank_dtype=bank_dtype,
                                              seed=47)
    full = cpu.forward(emb, labels, centres, cl, nb, w, s)
    check(full, reference(emb, labels, centres, cl, nb, w, s), torch.float32)
    fwd = cpu.forward(emb, labels, centres, cl, nb, w, s, need_grad_x=False)
    for a, b in zip(full[:3] + full[4:], fwd[:3] + fwd[4:]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


# Row lengths for the second pass's column blocks (grad_pass in csrc/op.cpp: blocks of 16,
# 8, 4, 2 and 1 sets of 16 lanes with AVX-512 fp32, half as many with fp64 or AVX2, then the
# ragged end element by element): below one set, one set exactly and one over, every block
# size once (496 = 256 + 128 + 64 + 32 + 16), and past the largest block with a ragged end.
SECOND_PASS_D = [1, 15, 16, 17, 48, 112, 496, 529]


@kernel
@pytest.mark.parametrize("bank_dtype", FLOATS)
@pytest.mark.parametrize("D", SECOND_PASS_D)
def test_second_pass_blocks_match_fp64(bank_dtype, D):
    """The two-pass gradient at every column block and ragged end, against the fp64 contract
    (padding, duplicates, no positive and a zero weight: make), with the forward-only bits.
    A row of a single class gives every entry a zero coefficient (no entry enters the pass):
    gradient 0 exactly.

    The coefficients of a row sum to 0 (p and p^R each sum to 1), so x's term cancels from
    sum_j a_j (c_j - x) in exact arithmetic: only rounding shows which x a block subtracts.
    With fp32 / fp64 banks every column is therefore shifted by its own large offset, embeddings
    and centres alike (the distances keep their size): a block that took another block's
    elements of x would sum terms of ~1e4 that cancel, far outside the tolerance."""
    emb, labels, centres, cl, nb, w, s = make(B=9, K=11, D=D, N=40, bank_dtype=bank_dtype,
                                              seed=53)
    if bank_dtype in (torch.float32, torch.float64):
        shift = 1e4 * ((torch.arange(D) * 5) % 11 + 1).float()
        # in fp32 first: the kernel computes in fp32, the reference from the same values
        emb, centres = emb + shift, (centres.float() + shift).to(bank_dtype)
    full = cpu.forward(emb, labels, centres, cl, nb, w, s)
    check(full, reference(emb, labels, centres, cl, nb, w, s), torch.float32)
    fwd = cpu.forward(emb, labels, centres, cl, nb, w, s, need_grad_x=False)
    for a, b in zip(full[:3] + full[4:], fwd[:3] + fwd[4:]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    emb64 = emb.double()
    full = cpu.forward(emb64, labels, centres, cl, nb, w, s.double())
    check(full, reference(emb64, labels, centres, cl, nb, w, s.double()), torch.float64)
    out = cpu.forward(emb, torch.zeros_like(labels), centres, torch.zeros_like(cl),
                      nb.clamp_min(0), None, s)
    assert torch.equal(out[3], torch.zeros(9, D))


@kernel
@pytest.mark.parametrize("bank_dtype,K,D",
                         ONE_PASS[:2] + ONE_PASS[-1:] + [(torch.float32, 12, 128)])
@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1e3, 1e18])
def test_one_pass_gradient_at_extreme_scales(bank_dtype, K, D, scale):
    """The single-pass gradient stays exact when embeddings, centres and sigma are scaled
    together far from 1: at 1e18 the unscaled squared distances overflow fp32 (scale before
    squaring, docs/MATHS.md section 4), at 1e-20 they underflow. A NaN embedding still gives a
    NaN row (loss and every gradient element). K 12, D 128: the two-pass gradient over the
    one-at-a-time distances (row_distances_fixed) at the same scales."""
    emb, labels, centres, cl, nb, w, _ = make(B=7, K=K, D=D, N=60, bank_dtype=bank_dtype,
                                              seed=41)
    emb = (emb.double() * scale).float()
    centres = (centres.double() * scale).to(bank_dtype)
    inputs = (emb, labels, centres, cl, nb, w, torch.tensor(51.0 * scale))
    check(cpu.forward(*inputs), reference(*inputs), torch.float32)
    emb = emb.clone()
    emb[5, 7] = float("nan")
    out = cpu.forward(emb, labels, centres, cl, nb, w, inputs[-1])
    assert torch.isnan(out[0][5]) and torch.isnan(out[3][5]).all()
    assert not torch.isnan(out[3][6]).any()


@kernel
@pytest.mark.parametrize("bank_dtype,K,D",
                         ONE_PASS[:2] + ONE_PASS[-1:] + [(torch.float32, 8, 16)])
def test_gradient_special_rows(bank_dtype, K, D):
    """On both gradient paths (single pass above ONE_PASS_BYTES, two passes below): one class
    only gives loss 0 and gradient 0 exactly (the two running sums take identical steps); a
    non-finite centre gives a NaN row; a row whose entries all have zero weight gives loss 0
    and a zero gradient (grad_x comes uninitialised from torch.empty: the kernel must write
    it)."""
    emb, labels, centres, cl, nb, w, s = make(B=5, K=K, D=D, N=50, bank_dtype=bank_dtype,
                                              weights=False, seed=43)
    nb = nb.clamp_min(0)
    out = cpu.forward(emb, torch.zeros_like(labels), centres, torch.zeros_like(cl), nb, None, s)
    assert torch.equal(out[0], torch.zeros(5)) and torch.equal(out[3], torch.zeros(5, D))
    bad = centres.clone()
    bad[nb[2, K // 2], 3] = float("inf")
    out = cpu.forward(emb, labels, bad, cl, nb, None, s)
    assert torch.isnan(out[0][2]) and torch.isnan(out[3][2]).all()
    zero_w = torch.ones(50)
    zero_w[nb[1]] = 0.0
    out = cpu.forward(emb, labels, centres, cl, nb, zero_w, s)
    assert torch.equal(out[3][1], torch.zeros(D)) and out[0][1].item() == 0.0


@kernel
def test_empty_bank_and_empty_batch():
    D = 5
    emb = torch.randn(4, D)
    out = cpu.forward(emb, torch.zeros(4, dtype=torch.long), torch.empty(0, D),
                      torch.empty(0, dtype=torch.long), torch.full((4, 3), -1), None,
                      torch.tensor(1.0))
    loss, la, lp, g, dist = out
    assert torch.equal(loss, torch.zeros(4)) and torch.equal(g, torch.zeros(4, D))
    assert (la == -math.inf).all() and (lp == -math.inf).all()
    assert torch.equal(dist, torch.zeros(4, 3))
    out = cpu.forward(torch.empty(0, D), torch.empty(0, dtype=torch.long), torch.randn(3, D),
                      torch.zeros(3, dtype=torch.long), torch.empty(0, 2, dtype=torch.long),
                      None, torch.tensor(1.0))
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0,), (0, D), (0, 2)]
    grad = cpu.centre_grad(emb, torch.empty(0, D), torch.full((4, 3), -1), torch.ones(4, 3))
    assert grad.shape == (0, D)


@kernel
@pytest.mark.parametrize("bank_dtype,D", [(torch.float32, 6), (torch.float16, 6),
                                          (torch.float32, 128), (torch.bfloat16, 64)])
def test_nonfinite_rows_are_nan_never_no_positive(bank_dtype, D):
    emb, labels, centres, cl, nb, w, s = make(B=8, K=5, D=D, N=12, bank_dtype=bank_dtype,
                                              seed=5)
    nb[:, :] = torch.arange(5)[None, :] + 1
    nb[0, 2] = -1
    emb = emb.clone()
    emb[0, 1] = float("nan")                # NaN in x
    centres = centres.clone()
    centres[11, 0] = float("inf")           # inf in a gathered centre...
    nb[1, 4] = 11
    w = w.clone()
    w[11] = 0.0                             # ...even behind a zero weight
    emb[2] = 1e30                           # fp32 overflow of u (finite in fp64)
    nb[3, 0] = 7
    w[7] = float("nan")                     # a NaN weight
    nb[4, 0] = 8
    w[8] = -1.0                             # a negative weight
    labels[5] = 99                          # a finite row without a positive, for contrast
    inputs = (emb, labels, centres, cl, nb, w, torch.tensor(1.0))
    out = cpu.forward(*inputs)
    for b in range(5):
        assert torch.isnan(out[0][b]) and torch.isnan(out[1][b]) and torch.isnan(out[2][b])
        assert torch.isnan(out[3][b]).all()
    assert out[0][5] == 0 and out[2][5] == -math.inf
    check(out, reference(*inputs), torch.float32)


@kernel
@pytest.mark.parametrize("D", [13, 128])
@pytest.mark.parametrize("need_grad_x", [True, False])
def test_index_past_the_bank_poisons_its_row(D, need_grad_x):
    """The op's checks refuse it, but the kernel never reads past the bank: an index >= N
    makes its row NaN (loss, log-sum-exps, grad_x; its distance NaN, padding's 0), the
    other rows are untouched."""
    emb, labels, centres, cl, nb, w, s = make(B=6, K=9, D=D, N=20, seed=8)
    bad = nb.clone()
    bad[2, 4] = 20
    bad[3, 0] = 10 ** 6
    out = cpu.forward(emb, labels, centres, cl, bad, w, s, need_grad_x=need_grad_x)
    ref = cpu.forward(emb, labels, centres, cl, nb, w, s, need_grad_x=need_grad_x)
    for b in (2, 3):
        assert all(torch.isnan(t[b]).all() for t in out[:3])
        if need_grad_x:
            assert torch.isnan(out[3][b]).all()
    assert torch.isnan(out[4][2, 4]) and torch.isnan(out[4][3, 0])
    assert (out[4][0, 1:] == 0).all()  # row 0 is mostly padding
    keep = torch.tensor([0, 1, 4, 5])
    for got, want in zip(out, ref):
        assert torch.equal(got[keep], want[keep])


@kernel
def test_store_dist_off():
    inputs = make(seed=6)
    on = cpu.forward(*inputs)
    off = cpu.forward(*inputs, store_dist=False)
    assert off[4].shape == (9, 0)
    for a, b in zip(on[:4], off[:4]):
        assert torch.equal(a, b)


@kernel
def test_threads_give_identical_results(monkeypatch):
    inputs = make(B=200, K=40, D=70, N=300, seed=7)  # above PARALLEL_MIN_ELEMS
    coef = torch.randn(200, 40)
    coef[coef.abs() < 0.3] = 0
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.forward(*inputs), cpu.centre_grad(inputs[0], inputs[2], inputs[4], coef)
        torch.set_num_threads(3)
        many = cpu.forward(*inputs), cpu.centre_grad(inputs[0], inputs[2], inputs[4], coef)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(one[0], many[0]):
        assert torch.equal(a, b)
    assert torch.equal(one[1], many[1])
    check(one[0], reference(*inputs), torch.float32)


@kernel
@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bank_dtype", FLOATS)
@pytest.mark.parametrize("idx_dtype", INDEX)
def test_centre_grad_matches_fp64(emb_dtype, bank_dtype, idx_dtype):
    emb, _, centres, _, nb, _, _ = make(B=11, K=6, D=37, N=15, emb_dtype=emb_dtype,
                                        bank_dtype=bank_dtype, idx_dtype=idx_dtype, seed=8)
    cdt = torch.float64 if emb_dtype == torch.float64 else torch.float32
    coef = torch.randn(11, 6, dtype=cdt)
    coef[0, 0] = 0
    got = cpu.centre_grad(emb, centres, nb, coef)
    assert got.dtype == cdt and got.shape == (15, 37)
    want = torch.zeros(15, 37, dtype=torch.float64)
    x = emb.to(cdt).double()
    for b in range(11):
        for k in range(6):
            j = int(nb[b, k])
            if j >= 0:
                want[j] += coef[b, k].double() * (x[b] - centres[j].double())
    tol = 1e-5 if cdt == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@kernel
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_op_on_the_cpu_backend_matches_torch_path(backend):
    """The op dispatches CPU tensors to the compiled kernel ("auto" too): value and every
    gradient as the plain path's."""
    emb, labels, centres, cl, nb, w, s = make(B=10, K=6, D=9, N=25, seed=9)
    import nnkloss
    grads = []
    for be in (backend, "torch"):
        x = emb.clone().requires_grad_(True)
        c = centres.float().clone().requires_grad_(True)
        ww = (torch.ones(centres.shape[0]) if w is None else w.float()).clone().requires_grad_(True)
        ss = torch.tensor(float(s), requires_grad=True)
        out = nnkloss.neighbour_kernel_loss(x, labels, c, cl, nb, ww, ss, backend=be)
        grads.append([out] + list(torch.autograd.grad(out, [x, c, ww, ss])))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("idx_dtype,cl_dtype", [(torch.int32, torch.int64),
                                                (torch.int64, torch.int32)])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 6, 300])
def test_entry_grads_match_the_torch_form(monkeypatch, dtype, idx_dtype, cl_dtype, w_dtype, K):
    """The centre, weight and sigma gradients of the CPU backend come from one compiled pass
    over the saved distances (cpu.entry_grads, spied); they match the torch form's on rows
    of padding, duplicates, a zero weight, no positive, and an incoming gradient that is an
    expanded scalar (the mean) or per row with zeros (reduction "none")."""
    emb, labels, centres, cl, nb, w, s = make(B=9, K=K, D=13, N=40, seed=K, idx_dtype=idx_dtype,
                                              cl_dtype=cl_dtype)
    w = w.to(w_dtype)
    calls = []
    real = cpu.entry_grads

    def spy(*a, **kw):
        calls.append(a[-3:])
        return real(*a, **kw)
    monkeypatch.setattr(cpu, "entry_grads", spy)
    row_grad = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0, 3.0, 1.0, 1.0])
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-13)
    for kw in (dict(), dict(reduction="none", row_grad=row_grad)):
        calls.clear()
        got = centre_weight_sigma_grads("cpu", emb, labels, centres, cl, nb, w, s, dtype, **kw)
        assert calls == [(True, True, True)]
        want = centre_weight_sigma_grads("torch", emb, labels, centres, cl, nb, w, s, dtype,
                                          **kw)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **tol)
        if K > 1:  # the zero weight's one-sided derivative (alone in its list at K 1: no row)
            assert got[3][w == 0].abs().sum() > 0


@kernel
def test_entry_grads_nan_rows_and_rows_that_take_no_gradient():
    check_entry_terms_of_nan_rows("cpu")


@kernel
def test_entry_grads_double_backward_runs_the_torch_form(monkeypatch):
    """With create_graph=True the backward is itself recorded: the torch form runs (the
    compiled pass is not differentiable), and the second derivative matches the torch
    backend's."""
    import nnkloss
    emb, labels, centres, cl, nb, w, s = make(B=5, K=4, D=6, N=20, seed=4)
    calls = []
    monkeypatch.setattr(cpu, "entry_grads", lambda *a, **k: calls.append(1))
    out = []
    for backend in ("cpu", "torch"):
        ww = w.double().clone().requires_grad_(True)
        ss = torch.tensor(float(s), dtype=torch.float64, requires_grad=True)
        with nnkloss.value_checks(False):
            loss = nnkloss.neighbour_kernel_loss(emb.double(), labels, centres.double(), cl, nb,
                                                 ww, ss, backend=backend)
        (g_s,) = torch.autograd.grad(loss, [ss], create_graph=True)
        (h,) = torch.autograd.grad(g_s, [ww])  # d2 L / dsigma dw
        out.append((g_s.detach(), h))
    assert calls == []
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b)
    assert out[0][1].abs().sum() > 0


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_rows(dtype):
    grad_x = torch.randn(300, 500, dtype=dtype)
    g = torch.randn(300, dtype=dtype)
    g[3] = 0
    grad_x[3, 0] = float("nan")  # a row that takes no gradient passes none on
    assert torch.equal(cpu.scale_rows(grad_x, g), torch.where((g != 0)[:, None],
                                                              g[:, None] * grad_x, 0.0))


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_rows_applies_the_row_rule_of_lse_pos_and_reads_an_expanded_g(dtype):
    """The backward's row rule inside the kernel: rows whose lse_pos is -inf (no same-class
    neighbour) and rows with g 0 get 0 whatever grad_x holds; a NaN lse_pos row is counted and
    keeps its NaN; g may be an expanded scalar (stride 0) or a strided view."""
    gen = torch.Generator().manual_seed(3)
    grad_x = torch.randn(37, 70, dtype=dtype, generator=gen)
    lse_pos = torch.randn(37, dtype=dtype, generator=gen)
    lse_pos[[2, 9]] = float("-inf")
    lse_pos[5] = float("nan")
    grad_x[[2, 5, 11], 3] = float("nan")
    g_full = torch.randn(37, 2, dtype=dtype, generator=gen)[:, 1]  # stride 2
    g_full[11] = 0
    for g in (torch.tensor(0.25, dtype=dtype).expand(37), g_full):
        takes = (g != 0) & (lse_pos != float("-inf"))
        want = torch.where(takes[:, None], g[:, None] * grad_x, 0.0)
        got = cpu.scale_rows(grad_x, g, lse_pos)
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[5, 3]
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert not got[[2, 9]].any() and (g[11] != 0 or not got[11].any())
    # g of another length is not read past its end: torch's broadcasting rules it out
    with pytest.raises(RuntimeError):
        cpu.scale_rows(grad_x, torch.ones(36, dtype=dtype), lse_pos)


@kernel
@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.float64])
def test_forward_with_mean_writes_counted_and_their_mean_in_the_same_call(emb_dtype, recorded):
    """``mean=True``: one nnk_forward call also gives counted (lse_pos not -inf: a NaN row
    counts) and the counted mean and divisor, within rounding of torch's sum / count (the same
    bits on every call); an empty batch: 0 and 1."""
    from nnkloss.ops import reference as ops_ref
    emb, labels, centres, cl, nb, w, s = make(B=11, K=6, D=9, N=30, emb_dtype=emb_dtype,
                                              seed=21)
    emb[5, 0] = float("nan")
    for weights in (w, None):
        five = cpu.forward(emb, labels, centres, cl, nb, weights, s)
        recorded.calls.clear()
        out = cpu.forward(emb, labels, centres, cl, nb, weights, s, mean=True)
        assert recorded.names() == ["nnk_forward"] and len(out) == 8
        for a, b in zip(out[:5], five):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        counted, mean, divisor = out[5:]
        assert torch.equal(counted, ops_ref.counted_rows(out[2])) and counted[5]
        assert not counted[2]  # no positive
        assert divisor.dtype == mean.dtype == out[0].dtype
        assert divisor.item() == counted.sum().item() and mean.isnan()
    ok = torch.ones(11, dtype=torch.bool)
    ok[5] = False
    out = cpu.forward(emb[ok], labels[ok], centres, cl, nb[ok], w, s, mean=True)
    want = ops_ref.counted_mean(out[0].double(), out[5])[0]
    again = cpu.forward(emb[ok], labels[ok], centres, cl, nb[ok], w, s, mean=True)
    assert torch.equal(out[6], again[6]) and torch.equal(out[7], again[7])
    torch.testing.assert_close(out[6].double(), want, rtol=1e-6, atol=0)
    empty = cpu.forward(emb[:0], labels[:0], centres, cl, nb[:0], w, s, mean=True)
    assert empty[6].item() == 0 and empty[7].item() == 1 and empty[5].shape == (0,)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_rows_divides_a_mean_gradient_with_the_bits_of_torchs_division(dtype, recorded):
    """A 0-dim g and the mean's divisor are read as they are (one call, no scalar built
    first) and give the bits of torch's ``g / divisor`` then the scaling; a g or divisor of
    another dtype is divided first in its own dtype, as torch's form does."""
    from nnkloss.ops import reference as ops_ref
    gen = torch.Generator().manual_seed(5)
    grad_x = torch.randn(13, 7, dtype=dtype, generator=gen)
    lse_pos = torch.randn(13, dtype=dtype, generator=gen)
    lse_pos[4] = float("-inf")
    for g, divisor in ((torch.tensor(0.3, dtype=dtype), torch.tensor(7.0, dtype=dtype)),
                       (torch.randn(13, dtype=dtype, generator=gen),
                        torch.tensor(3.0, dtype=dtype)),
                       (torch.tensor(0.3, dtype=torch.float64),
                        torch.tensor(7.0, dtype=torch.float64)),
                       (torch.tensor(0.3, dtype=dtype), None)):
        recorded.calls.clear()
        got = cpu.scale_rows(grad_x, g, lse_pos, divisor)
        assert recorded.names() == ["nnk_scale_rows"]
        assert torch.equal(got, ops_ref.scale_rows(grad_x, g, lse_pos, dtype, divisor))
        assert not got[4].any()


@kernel
def test_op_nan_row_reaches_the_mean_on_the_cpu_backend():
    emb, labels, centres, cl, nb, w, s = make(B=6, K=4, D=5, N=12, seed=12)
    emb = emb.clone()
    emb[4, 0] = float("nan")
    x = emb.clone().requires_grad_(True)
    import nnkloss
    with nnkloss.value_checks(False):
        loss = nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, w, s, backend="cpu")
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(x.grad[4]).all()


def test_unsupported_dtypes_fall_back():
    emb, labels, centres, cl, nb, w, s = make(seed=10, weights=False)
    out = cpu.forward(emb, labels, centres, cl.to(torch.int16), nb, w, s)
    ref = reference(emb, labels, centres, cl, nb, w, s)
    check(out, ref, torch.float32, dist_too=False)


class _Recorder:
    """Stands in for the loaded library and records which of its entry points ran (and with
    what), so a test can tell the compiled path from the plain fallback that gives the same
    numbers."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls.append((name, args))
            return fn(*args)
        return call

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture
def recorded(monkeypatch):
    rec = _Recorder(build.lib())
    monkeypatch.setattr(build, "lib", lambda: rec)
    return rec


@kernel
@pytest.mark.parametrize("emb_dtype,bank_dtype,idx_dtype", [
    (torch.float32, torch.float32, torch.int64), (torch.float64, torch.bfloat16, torch.int32),
    (torch.bfloat16, torch.float16, torch.int32)])
def test_supported_inputs_run_the_compiled_kernel(recorded, emb_dtype, bank_dtype, idx_dtype,
                                                  monkeypatch):
    """The fast path is what runs (its fallback gives the same numbers, so only this tells a
    lost fast path from a working one): forward, centre_grad and scale_rows each call their
    entry point once, with the documented thread count."""
    emb, labels, centres, cl, nb, w, s = make(emb_dtype=emb_dtype, bank_dtype=bank_dtype,
                                              idx_dtype=idx_dtype, cl_dtype=idx_dtype, seed=21)
    B, K = nb.shape
    D = emb.shape[1]
    cpu.forward(emb, labels, centres, cl, nb, w, s)
    cpu.centre_grad(emb, centres, nb, torch.ones(B, K))
    cdt = torch.float64 if emb_dtype == torch.float64 else torch.float32
    cpu.scale_rows(torch.randn(B, D, dtype=cdt), torch.randn(B, dtype=cdt))
    assert recorded.names() == ["nnk_forward", "nnk_centre_grad", "nnk_scale_rows"]
    for _, args in recorded.calls:
        assert args[0] == int(cdt == torch.float64)          # compute-dtype flag
    assert recorded.calls[0][1][-1] == build.threads(B * K * D)
    assert recorded.calls[1][1][-1] == build.threads(B * K * D)
    assert recorded.calls[2][1][-1] == build.threads(B * D, cpu.op.SCALE_MIN_ELEMS)


@kernel
@pytest.mark.parametrize("case", ["centre_labels int16", "neighbours int16", "integer weights",
                                  "strided centres", "strided centre_labels", "emb 1-D rows",
                                  "dim mismatch", "emb int"])
def test_unsupported_inputs_take_the_plain_path(recorded, case):
    """Each condition of ``_supported`` on its own sends the call to the plain path (the
    kernel would read such tensors wrongly), with the plain path's results."""
    from nnkloss.ops import reference as torch_path
    emb, labels, centres, cl, nb, w, s = make(seed=22)
    if case == "centre_labels int16":
        cl = cl.to(torch.int16)
    elif case == "neighbours int16":
        nb = nb.to(torch.int16)
    elif case == "integer weights":
        w = torch.ones(centres.shape[0], dtype=torch.int64)
    elif case == "strided centres":
        centres = torch.cat([centres, centres], 1)[:, ::2]
    elif case == "strided centre_labels":
        cl = torch.stack([cl, cl], 1)[:, 0]
    elif case == "emb 1-D rows":
        emb = emb[:, :1]
        centres = centres[:, :1].contiguous()
    elif case == "dim mismatch":
        centres = torch.cat([centres, centres], 1)
    elif case == "emb int":
        emb = emb.round().to(torch.int32)
    supported = cpu.op._supported(emb, centres, cl, nb, w)
    assert supported == (case == "emb 1-D rows")   # D = 1 is fine; the rest is not
    if case in ("dim mismatch", "emb int"):
        return                                     # the plain path refuses those too
    out = cpu.forward(emb, labels, centres, cl, nb, w, s)
    ref = torch_path.forward(emb, labels, centres, cl, nb, w, s)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)
    if not supported:                              # the fallback passes store_dist on
        assert cpu.forward(emb, labels, centres, cl, nb, w, s, store_dist=False)[4].shape == \
            (emb.shape[0], 0)
    grad = cpu.centre_grad(emb, centres, nb, torch.ones(nb.shape))
    torch.testing.assert_close(grad, torch_path.centre_grad(emb, centres, nb, torch.ones(nb.shape)))
    # centre_grad reads no centre_labels and no weights: only the other cases stop it
    grad_supported = case not in ("neighbours int16", "strided centres")
    assert recorded.names() == (["nnk_forward"] if supported else []) + \
        (["nnk_centre_grad"] if grad_supported else [])


@kernel
def test_scale_rows_falls_back_for_what_the_kernel_does_not_take(recorded):
    grad_x, g = torch.randn(5, 4), torch.randn(5)
    g[1] = 0
    grad_x[1, 2] = float("nan")
    for gx in (grad_x.bfloat16(), grad_x.t().contiguous().t(), grad_x.half()):
        want = torch.where((g.to(gx.dtype) != 0)[:, None], g.to(gx.dtype)[:, None] * gx, 0.0)
        assert torch.equal(cpu.scale_rows(gx, g), want)
    assert recorded.names() == []
    assert torch.equal(cpu.scale_rows(grad_x, g.double()),        # g cast to grad_x's dtype
                       torch.where((g != 0)[:, None], g[:, None] * grad_x, 0.0))
    assert recorded.names() == ["nnk_scale_rows"]


@kernel
@pytest.mark.parametrize("w_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_weight_dtypes_and_a_float_sigma(w_dtype):
    """Half-precision weights are widened to fp32, fp64 ones read as fp64; a Python float sigma
    works like a 0-dim tensor."""
    from nnkloss.ops import reference as torch_path
    emb, labels, centres, cl, nb, w, s = make(seed=24)
    w = w.to(w_dtype)
    out = cpu.forward(emb, labels, centres, cl, nb, w, float(s))
    for a, b in zip(out, torch_path.forward(emb, labels, centres, cl, nb, w, s), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@kernel
def test_centre_grad_edge_sizes_and_coef_dtype():
    """K = 1 lists, a one-centre bank and an fp64 coef with fp32 embeddings all go through the
    kernel with the plain path's results."""
    from nnkloss.ops import reference as torch_path
    g = torch.Generator().manual_seed(25)
    for B, K, N in ((4, 1, 6), (4, 3, 1)):
        emb, centres = torch.randn(B, 5, generator=g), torch.randn(N, 5, generator=g)
        nb = torch.randint(0, N, (B, K), generator=g)
        coef = torch.rand(B, K, generator=g, dtype=torch.float64)
        got = cpu.centre_grad(emb, centres, nb, coef)
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, torch_path.centre_grad(emb, centres, nb, coef))


@kernel
def test_thread_count_reaches_the_kernel(recorded, monkeypatch):
    """B*K*D sets the thread count passed to each entry point: one thread per
    PARALLEL_MIN_ELEMS; for scale_rows B*D, one per SCALE_MIN_ELEMS."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    emb, labels, centres, cl, nb, w, s = make(B=64, K=32, D=64, N=50, seed=26)
    cpu.forward(emb, labels, centres, cl, nb, w, s)
    cpu.centre_grad(emb, centres, nb, torch.ones(64, 32))
    cpu.scale_rows(torch.randn(1024, 256), torch.randn(1024))      # 2^18: one thread
    cpu.scale_rows(torch.randn(4096, 1024), torch.randn(4096))     # 2^22: four
    assert [args[-1] for _, args in recorded.calls] == [2, 2, 1, 4]


def test_kernel_error_codes_are_raised(monkeypatch):
    """A non-zero return code from an entry point is an error naming it and the code."""
    from types import SimpleNamespace
    fail = SimpleNamespace(nnk_forward=lambda *a: 3, nnk_centre_grad=lambda *a: 4,
                           nnk_scale_rows=lambda *a: 5)
    monkeypatch.setattr(build, "lib", lambda: fail)
    emb, labels, centres, cl, nb, w, s = make(seed=27)
    with pytest.raises(RuntimeError, match=r"^nnk_forward failed \(code 3\)$"):
        cpu.forward(emb, labels, centres, cl, nb, w, s)
    with pytest.raises(RuntimeError, match=r"^nnk_centre_grad failed \(code 4\)$"):
        cpu.centre_grad(emb, centres, nb, torch.ones(nb.shape))
    with pytest.raises(RuntimeError, match=r"^nnk_scale_rows failed \(code 5\)$"):
        cpu.scale_rows(torch.randn(3, 2), torch.ones(3))


@kernel
@pytest.mark.parametrize("emb_dtype,bank_dtype", [(torch.float32, torch.float32),
                                                   (torch.float64, torch.bfloat16),
                                                   (torch.float32, torch.float16)])
@pytest.mark.parametrize("store_dist", [True, False])
def test_forward_only_is_the_forward_without_grad_x(recorded, emb_dtype, bank_dtype, store_dist):
    """need_grad_x=False: the kernel is called without a grad_x buffer (NULL), grad_x comes
    back (B, 0), and loss, lse's and dist are bit for bit those of the full forward (the same
    first pass), non-finite rows included."""
    emb, labels, centres, cl, nb, w, s = make(B=12, emb_dtype=emb_dtype, bank_dtype=bank_dtype,
                                              seed=28)
    emb = emb.clone()
    emb[4, 0] = float("nan")
    full = cpu.forward(emb, labels, centres, cl, nb, w, s, store_dist=store_dist)
    fwd = cpu.forward(emb, labels, centres, cl, nb, w, s, store_dist=store_dist,
                      need_grad_x=False)
    assert recorded.names() == ["nnk_forward", "nnk_forward"]
    grad_ptr = [args[21] for _, args in recorded.calls]  # after the labels flag
    assert grad_ptr[0] == full[3].data_ptr() and grad_ptr[1] is None
    assert fwd[3].shape == (12, 0) and fwd[3].dtype == full[3].dtype
    for a, b in zip(full[:3] + full[4:], fwd[:3] + fwd[4:]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.isnan(fwd[0][4]) and torch.isnan(fwd[2][4])
    ref = reference(emb, labels, centres, cl, nb, w, s)
    check(full, ref, full[0].dtype, dist_too=store_dist)


@kernel
def test_forward_only_threads_and_empty_batch():
    inputs = make(B=200, K=40, D=70, N=300, seed=29)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.forward(*inputs, need_grad_x=False)
        torch.set_num_threads(3)
        many = cpu.forward(*inputs, need_grad_x=False)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(one, many):
        assert torch.equal(a, b)
    emb, labels, centres, cl, nb, w, s = inputs
    out = cpu.forward(emb[:0], labels[:0], centres, cl, nb[:0], w, s, need_grad_x=False)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0,), (0, 0), (0, 40)]


@kernel
def test_forward_exp_is_within_one_ulp_of_exp():
    """The forward's vectorised exp (vexp) against fp64 exp over its whole input range: at
    most ~1 ulp off for normal results (1.01 ulp measured exhaustively over every fp32 in
    [-110, 0]), exact at 0, exactly 0 for -inf (invalid entries) and below the fp32 range,
    NaN for NaN. A looser polynomial or a wrong 2^n scaling fails here."""
    x = torch.cat([torch.linspace(-104.0, 0.0, 1 << 21), torch.linspace(-1.0, 0.0, 1 << 16),
                   torch.tensor([0.0, -0.0, -1e-30, -87.33, -103.2, -110.0, -1e4])])
    got = cpu.forward_exp(x).double()
    want = torch.exp(x.double())
    spacing = torch.nextafter(want.float(), torch.tensor(math.inf)).double() - want.float().double()
    normal = want >= torch.finfo(torch.float32).tiny
    ulps = ((got - want).abs() / spacing)[normal]
    assert ulps.max().item() <= 1.05, ulps.max().item()
    sub = ~normal
    assert ((got - want).abs()[sub] <= 2.0 ** -148).all()  # subnormal results: absolute
    assert got[x == 0].eq(1.0).all() and got[x < -104].eq(0.0).all()
    special = cpu.forward_exp(torch.tensor([-math.inf, math.nan, 100.0]))
    assert special[0].item() == 0.0 and math.isnan(special[1].item())
    assert special[2].item() == math.inf  # beyond fp32's range, as exp


@kernel
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("D", [16, 64, 70, 128, 256])
def test_distance_does_not_depend_on_position_in_the_list(bank_dtype, D):
    """Pass 1 computes live entries four at a time and the remainder one at a time: a centre's
    distance must come out bit for bit the same wherever it stands (in a group, in the
    remainder, after padding that shifts the groups). At D 64, 128 and 256, fp32 and bf16
    rows are read one at a time at a compile-time D (row_distances_fixed), the K = 1 call below
    too: its distance must equal the one computed by a group of four at a runtime D (fp64,
    fp16 banks, and D 16 and 70)."""
    g = torch.Generator().manual_seed(31)
    N = 12
    centres = torch.randn(N, D, generator=g).to(bank_dtype)
    cl = torch.arange(N) % 3
    emb = torch.randn(3, D, generator=g)
    labels = torch.tensor([0, 1, 2])
    nb = torch.tensor([[5, 1, 2, 3, 4, 5, 6, 7, 8, 5],         # 5 in group 1, group 2, remainder
                       [-1, 5, 0, -1, 5, 9, 10, 11, 5, -1],    # padding shifts the groups
                       [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]])
    out = cpu.forward(emb, labels, centres, cl, nb, None, torch.tensor(2.3))
    dist = out[4]
    for b in range(3):
        at = dist[b][nb[b] == 5]
        assert torch.equal(at, at[:1].expand_as(at)), (b, at)
    assert torch.equal(dist[0, 0], cpu.forward(emb[:1], labels[:1], centres, cl, nb[:1, :1],
                                               None, torch.tensor(2.3))[4][0, 0])


# ------------------------------------------------------------ the bank's lists (gather_lists)
@kernel
@pytest.mark.parametrize("table_dtype", INDEX, ids=str)
@pytest.mark.parametrize("idx_dtype", INDEX, ids=str)
@pytest.mark.parametrize("exclude_self", [True, False], ids=["exclude", "keep"])
def test_gather_lists_is_torch_gather_and_own_index_fill(table_dtype, idx_dtype, exclude_self):
    """table[idx] with each row's own index -1: own index anywhere, twice, padding -1 kept,
    repeated idx, odd K (past a vector width)."""
    g = torch.Generator().manual_seed(3)
    N, K = 50, 37
    table = torch.randint(-1, N, (N, K), generator=g)
    table[:, 5] = torch.arange(N)                # own index inside the list
    table[::3, 36] = torch.arange(N)[::3]        # and at the end, twice for some rows
    table = table.to(table_dtype)
    idx = torch.cat([torch.randint(0, N, (40,), generator=g), torch.tensor([0, N - 1, 7, 7])])
    idx = idx.to(idx_dtype)
    want = table[idx.long()]
    if exclude_self:
        want = want.masked_fill(want == idx.long()[:, None], -1)
    got = cpu.gather_lists(table, idx, exclude_self)
    assert got.dtype == table_dtype and torch.equal(got, want)
    assert (got == -1).sum() > (table[idx.long()] == -1).sum() or not exclude_self
    empty = cpu.gather_lists(table, torch.empty(0, dtype=idx_dtype), exclude_self)
    assert empty.shape == (0, K) and empty.dtype == table_dtype


@kernel
def test_gather_lists_leaves_what_it_does_not_do_to_the_caller():
    """None (the caller's torch path and range check take over): an idx outside [0, N), an
    index dtype the library does not read, a non-contiguous table."""
    table = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    for bad in ([0, 4], [-1, 0], [2**40]):
        assert cpu.gather_lists(table, torch.tensor(bad), True) is None
    assert cpu.gather_lists(table, torch.tensor([0], dtype=torch.int16), True) is None
    assert cpu.gather_lists(table.t(), torch.tensor([0]), True) is None
    assert torch.equal(cpu.gather_lists(table, torch.tensor([3, 1]), False), table[[3, 1]])


@kernel
@pytest.mark.parametrize("K,D", [(20, 16), (12, 128), (9, 96), (9, 300), (900, 304), (20, 37),
                                 (900, 300)])
def test_bf16_bank_is_the_fp32_bank_of_its_values(K, D):
    """bf16 centre rows are converted to fp32 a vector at a time (load_lanes<float, bf16>) and
    the gradient's row updates run ACC elements at a time with a ragged end one at a time
    (axpy_diff, axpy_diff4): a bf16 bank must give what an fp32 bank holding the same values
    gives, on the two-pass path (K x D x 2 bytes up to 512 KiB, NNK_ONE_PASS_BYTES, the fp32
    bank's 4 bytes under it too) and the one-pass path (K 900: above it for both). Bit for bit
    where the rows have
    no ragged end within groups of four (D a multiple of 16, or rows distanced one at a time:
    K 9, D 300 is two groups and one single row, and the single row's tail is exact), and the
    loss always (CONTRACT.md 8: from the K logits). Where a group's rows end raggedly
    (D 37, 300 with K 20, 900) the compiler may contract the ragged end's multiply-adds
    differently for the two element types (as before the vector paths): distances and grad_x
    then agree to a few fp32 ulps."""
    emb, labels, centres, cl, nb, w, s = make(B=11, K=K, D=D, N=400, bank_dtype=torch.bfloat16,
                                              seed=53)
    emb = emb + 0.25  # neither bank's rows equal an embedding
    half = cpu.forward(emb, labels, centres, cl, nb, w, s)
    full = cpu.forward(emb, labels, centres.float(), cl, nb, w, s)
    assert half[3].abs().sum() > 0 and torch.isfinite(half[0]).all()
    assert torch.equal(half[0], full[0])
    exact = D % 16 == 0 or K == 9
    for a, b in zip(half[1:], full[1:]):
        if exact:
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item(),
                                       equal_nan=True)


@kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_compiled_value_flags_match_the_torch_reductions(dtype, index_dtype):
    """nnk_check_values reads the bits (an all-ones exponent: NaN / inf; a set sign on a
    nonzero weight: negative) in every float type, int32 and int64 lists: the list range and
    both flags equal what the torch reductions of check_values give, at every place of a
    vector and past it, -0.0 and tiny negative weights included."""
    from nnkloss.validation import maybe_nonfinite, negative_or_nonfinite, _every_value_finite
    g = torch.Generator().manual_seed(4)
    nb = torch.randint(-1, 50, (37, 5), generator=g).to(index_dtype)
    emb = torch.randn(37, 9, generator=g).to(dtype)
    w = torch.rand(70, generator=g).to(dtype)
    lo, hi, emb_bad, w_bad = cpu.value_flags(emb, nb, w)
    assert (lo, hi) == (int(nb.min()), int(nb.max())) and not emb_bad and not w_bad
    nb[3, 1], nb[30, 4] = -7, 2 ** 31 - 1
    assert cpu.value_flags(emb, nb, w)[:2] == (-7, 2 ** 31 - 1)
    for place in (0, 15, 16, 17, emb.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
            e = emb.clone()
            e.view(-1)[place] = bad
            assert cpu.value_flags(e, nb, w)[2] is True
            assert bool(maybe_nonfinite(e)) and not _every_value_finite(e)
    big = torch.full_like(emb, torch.finfo(dtype).max)  # finite, whose sum overflows
    assert cpu.value_flags(big, nb, None) == (-7, 2 ** 31 - 1, False, False)
    for value in (0.0, -0.0, 1e-30, -1e-30, -1.0, float("nan"), -float("nan"), float("inf"),
                  float("-inf"), torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 4):
        for place in (0, 31, 69):
            ww = w.clone()
            ww[place] = value
            want = bool(negative_or_nonfinite(ww))
            assert cpu.value_flags(emb, nb, ww)[3] is want, (value, place)
    empty = cpu.value_flags(emb[:0], nb[:0], w[:0])
    assert empty[2:] == (False, False)
    assert cpu.value_flags(emb.t(), nb, w) is None  # not contiguous: the torch path


@kernel
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("index_dtype", INDEX, ids=str)
def test_gathered_rows_finite_reads_only_the_listed_rows(dtype, index_dtype, monkeypatch):
    """nnk_gathered_finite: NaN / inf / -inf in a listed row (first, middle and last column
    of rows whose width is no multiple of the vector) found, the same value in an unlisted or
    padded-away row ignored; 1,300 entries are three items, on one thread or two."""
    g = torch.Generator().manual_seed(13)
    D = 37
    centres = torch.randn(90, D, generator=g).to(dtype)
    nb = torch.randint(0, 80, (100, 13), generator=g)  # rows 80-89 never listed
    nb[torch.rand(100, 13, generator=g) < 0.2] = -1
    nb = nb.to(index_dtype)
    assert cpu.gathered_rows_finite(centres, nb).item() is True
    listed = int(nb[-1][nb[-1] >= 0][-1])
    for threads in (1, 2):
        monkeypatch.setattr(build, "threads", lambda work, min_elems=None: threads)
        for value, col in ((float("nan"), D - 1), (float("inf"), 0), (-float("inf"), 17)):
            bad = centres.clone()
            bad[listed, col] = value
            got = cpu.gathered_rows_finite(bad, nb)
            assert got.dtype == torch.bool and got.dim() == 0 and not got
            unlisted = centres.clone()
            unlisted[85, col] = value
            assert cpu.gathered_rows_finite(unlisted, nb)
            assert cpu.gathered_rows_finite(bad, nb.masked_fill(nb == listed, -1))


@kernel
def test_gathered_rows_finite_edges_and_what_it_leaves_to_the_caller():
    cpu.available()  # loaded here: a value check never builds the library itself
    c = torch.randn(5, 4)
    assert cpu.gathered_rows_finite(c, torch.zeros(3, 0, dtype=torch.long))
    assert cpu.gathered_rows_finite(c, torch.full((2, 2), -1))
    assert cpu.gathered_rows_finite(torch.full((2, 3), 1e300, dtype=torch.float64),
                                    torch.tensor([0, 1]))  # large, finite
    # entries outside the bank are not rows: not read (the value checks name them); a NaN
    # behind them stays unseen, one in a listed row is found
    bad_row = c.clone()
    bad_row[0, 1] = float("nan")
    for bad in (5, -2):
        assert cpu.gathered_rows_finite(c, torch.tensor([[0, bad]]))
        assert cpu.gathered_rows_finite(bad_row, torch.tensor([[1, bad]]))
        assert not cpu.gathered_rows_finite(bad_row, torch.tensor([[0, bad]]))
    assert cpu.gathered_rows_finite(c.t().contiguous().t(), torch.tensor([0])) is None
    assert cpu.gathered_rows_finite(c, torch.tensor([0.0])) is None


def _has_same_label_torch(nb, cl):
    nb, cl = nb.long(), cl.long()
    return ((cl[nb.clamp_min(0)] == cl[:, None]) & (nb >= 0)).any(1)


@kernel
@pytest.mark.parametrize("nb_dtype", INDEX, ids=str)
@pytest.mark.parametrize("cl_dtype", INDEX, ids=str)
def test_has_same_label_is_the_torch_form(nb_dtype, cl_dtype):
    """nnk_has_same_label: a list holds its own row's label, read up to the first match:
    padding skipped, a match in the last slot found, all-padding and wrong-label rows False,
    the row itself counting as it does in torch's form; every width."""
    g = torch.Generator().manual_seed(12)
    n, k = 200, 9
    cl = torch.randint(0, 6, (n,), generator=g)
    nb = torch.randint(0, n, (n, k), generator=g)
    nb[torch.rand(n, k, generator=g) < 0.3] = -1
    other = (cl + 1) % 6
    wrong = (cl[None, :] == other[:, None]).float().argmax(1)  # a row of another label
    nb[10] = wrong[10]                         # no positive anywhere
    nb[11] = -1                                # all padding
    nb[12] = wrong[12]
    nb[12, -1] = (cl == cl[12]).nonzero()[-1, 0]  # the only positive in the last slot
    nb[13, 0] = 13                             # itself
    nb[13, 1:] = wrong[13]
    got = cpu.has_same_label(nb.to(nb_dtype).contiguous(), cl.to(cl_dtype))
    assert got.dtype == torch.bool and got.shape == (n,)
    assert torch.equal(got, _has_same_label_torch(nb, cl))
    assert not got[10] and not got[11] and got[12] and got[13]
    assert 0 < int(got.sum()) < n
    assert cpu.has_same_label(nb[:0].to(nb_dtype), cl[:0].to(cl_dtype)).shape == (0,)
    assert cpu.has_same_label(nb[:, :0].to(nb_dtype).contiguous(),
                              cl.to(cl_dtype)).sum() == 0


@kernel
def test_has_same_label_refuses_rows_outside_the_bank_and_leaves_other_cases():
    cl = torch.tensor([0, 1, 0, 1])
    nb = torch.tensor([[2, 1], [0, 3], [1, 0], [0, 2]])
    assert cpu.has_same_label(nb, cl).tolist() == [True, True, True, False]
    for bad in (4, -2):
        far = nb.clone()
        far[3, 1] = bad  # row 3 has no match, so its second entry is read
        with pytest.raises(IndexError, match=r"\[0, 4\)"):
            cpu.has_same_label(far, cl)
    # not done here (the caller's torch form runs): lists of other rows than the centres,
    # strided lists, float labels
    assert cpu.has_same_label(nb[:3], cl) is None
    assert cpu.has_same_label(nb.t().contiguous().t(), cl) is None
    assert cpu.has_same_label(nb, cl.float()) is None


@kernel
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("index_dtype", INDEX, ids=str)
def test_gather_read_reads_exactly_the_listed_rows(dtype, index_dtype):
    """The benchmarks' gather limit (nnk_gather_read) reads the rows the lists name, padding
    skipped, every byte of each (rows of 37 bf16 elements: 74 bytes, not a whole number of
    8-byte words), whatever the thread count: its XOR equals the XOR computed here."""
    g = torch.Generator().manual_seed(11)
    for D in (37, 64, 300):
        bank = torch.randn(900, D, generator=g).to(dtype)
        nb = torch.randint(-1, 900, (1100,), generator=g).to(index_dtype)  # > one item of 512
        raw = bank.view(torch.uint8).reshape(900, -1).numpy()
        words, tail = raw.shape[1] // 8, raw.shape[1] % 8
        want = 0
        for j in nb.tolist():
            if j < 0:
                continue
            row = raw[j]
            x = 0
            for w in row[:8 * words].view("<u8").tolist():
                x ^= w
            for b in row[8 * words:8 * words + tail].tolist():
                x ^= b
            want ^= x
        assert cpu.gather_read(bank, nb, 1) == want
        assert cpu.gather_read(bank, nb, 2) == want
    assert cpu.gather_read(bank, torch.full((5,), -1, dtype=index_dtype)) == 0
    with pytest.raises(IndexError, match="neighbours must lie in"):
        cpu.gather_read(bank, torch.tensor([0, 900], dtype=index_dtype))
    assert cpu.gather_read(bank.t(), nb) is None  # not contiguous: not done here


@kernel
@pytest.mark.parametrize("bank_dtype", FLOATS)
@pytest.mark.parametrize("cdt", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [1, 13, 16, 64, 70, 128, 256])
def test_rel_sqdist_matches_fp64(bank_dtype, cdt, D):
    # D 64, 128 and 256 with fp32 / bf16 banks: the compile-time D (rel_sqdist_rows<D>)
    check_rel_sqdist(cpu.rel_sqdist, bank_dtype, cdt, D)


@kernel
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_rel_sqdist_compile_time_d_gives_the_run_time_bits(bank_dtype, D):
    # The same rows padded with 16 zero columns go through the run-time D (D + 16 is none of
    # the fixed ones): one more step of the lanes that adds exact zeros, so the same bits are
    # owed. K = 11: two groups of four and three rows alone.
    g = torch.Generator().manual_seed(D)
    centres = torch.randn(50, D, generator=g).to(bank_dtype)
    x = torch.randn(7, D, generator=g) * 3
    idx = torch.randint(0, 50, (7, 11), generator=g)
    ref = idx[:, 2]
    fixed = cpu.rel_sqdist(x, centres, idx, ref, torch.float32)
    pad = lambda t: torch.cat([t, torch.zeros(t.shape[0], 16, dtype=t.dtype)], 1)
    run_time = cpu.rel_sqdist(pad(x), pad(centres), idx, ref, torch.float32)
    assert torch.equal(fixed, run_time)
    torch.testing.assert_close(fixed.double(), rel_sqdist_fp64(x, centres, idx, ref),
                               rtol=0, atol=1e-4 * D)


@kernel
def test_rel_sqdist_keeps_far_queries_precise_and_threads_agree(monkeypatch):
    # |x| = 1e4: the two squared distances are ~1e8 (fp32 spacing 8), their difference ~1e1;
    # the product form keeps it to fp32's relative precision, as the torch form does.
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(30, 6, generator=g)
    x = torch.randn(5, 6, generator=g) * 1e4
    idx = torch.randint(0, 30, (5, 8), generator=g)
    ref = idx[:, 0]
    got = cpu.rel_sqdist(x, centres, idx, ref, torch.float32).double()
    want = rel_sqdist_fp64(x, centres, idx, ref)
    tol = 1e-5 * want.abs().max().item()  # ~1; the difference of the two fp32 squares: ~8
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    monkeypatch.setattr(build, "threads", lambda work, min_elems=None: 2)
    big_idx = torch.randint(0, 30, (300, 8), generator=g)
    xs = torch.randn(300, 6, generator=g)
    two = cpu.rel_sqdist(xs, centres, big_idx, big_idx[:, 1], torch.float32)
    monkeypatch.setattr(build, "threads", lambda work, min_elems=None: 1)
    one = cpu.rel_sqdist(xs, centres, big_idx, big_idx[:, 1], torch.float32)
    assert torch.equal(one, two)


@kernel
def test_rel_sqdist_edges_and_what_it_leaves_to_the_caller():
    centres = torch.randn(10, 4)
    x = torch.randn(3, 4)
    assert cpu.rel_sqdist(x, centres, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3),
                          torch.float32).shape == (3, 0)
    assert cpu.rel_sqdist(x[:0], centres, torch.zeros(0, 2, dtype=torch.long),
                          torch.zeros(0, dtype=torch.long), torch.float32).shape == (0, 2)
    for bad in (10, -1):
        idx = torch.zeros(3, 2, dtype=torch.long)
        idx[2, 1] = bad
        with pytest.raises(IndexError, match=r"\[0, 10\)"):
            cpu.rel_sqdist(x, centres, idx, idx[:, 0], torch.float32)
        with pytest.raises(IndexError):
            cpu.rel_sqdist(x, centres, torch.zeros(3, 2, dtype=torch.long), idx[:, 1],
                           torch.float32)
    # not done here (the caller's torch form runs): a strided bank, an integer compute type
    assert cpu.rel_sqdist(x, centres.t().contiguous().t(), idx.clamp(0, 9), idx[:, 0].clamp(0),
                          torch.float32) is None
    assert cpu.rel_sqdist(x, centres, idx.clamp(0, 9), idx[:, 0].clamp(0), torch.int32) is None


@kernel
@pytest.mark.parametrize("wrong", ["labels", "centre_labels", "weights", "neighbours", "coef"])
def test_shapes_that_disagree_are_refused_before_the_library_reads(wrong):
    """The library reads B labels and list rows and N centre labels and weights through bare
    pointers. The functional op checks the shapes (validation.check_inputs), but a direct call
    of the custom ops (torch.ops.nnkloss.nk_forward / nk_centre_grad) reached the library with
    any: a labels, centre_labels, weights or neighbours tensor shorter than its dimension was
    read past its end (heap-buffer-overflow under AddressSanitizer, silent values otherwise).
    Now a ValueError; the backward's per-entry pass falls back to the torch form instead."""
    B, N, D, K = 4, 5, 8, 3
    g = torch.Generator().manual_seed(12)
    emb, centres = torch.randn(B, D, generator=g), torch.randn(N, D, generator=g)
    args = dict(labels=torch.zeros(B, dtype=torch.long), centre_labels=torch.zeros(N, dtype=torch.long),
                neighbours=torch.full((B, K), N - 1), weights=torch.ones(N))
    if wrong == "coef":
        with pytest.raises(ValueError, match="coef"):
            torch.ops.nnkloss.nk_centre_grad(emb, centres, args["neighbours"],
                                             torch.ones(1, K), "cpu")
        with pytest.raises(ValueError, match="coef"):
            torch.ops.nnkloss.nk_centre_grad(emb, centres, args["neighbours"][:1],
                                             torch.ones(1, K), "cpu")
        return
    args[wrong] = args[wrong][:1]
    with pytest.raises(ValueError, match="shapes disagree"):
        torch.ops.nnkloss.nk_forward(emb, args["labels"], centres, args["centre_labels"],
                                     args["neighbours"], args["weights"], torch.tensor(1.0),
                                     "cpu", True, True)
    if wrong != "neighbours":
        u = torch.zeros(B, K)
        lse = torch.zeros(B)
        assert not cpu.entry_grads_supported(u, args["labels"], args["centre_labels"],
                                             args["neighbours"], args["weights"], lse, lse,
                                             torch.ones(B))
