"""The compiled CPU kernel (nnkloss.ops.cpu) against an fp64 computation of nnkloss/ops/CONTRACT.md.

The reference is the tests' fp64 one (tests/reference.py ``forward``), row by row from the
values the kernel actually receives (emb converted to the compute dtype; bank values are exact
in fp32).
"""
import math
import os
import tempfile
import threading
import time
import warnings

import pytest
import torch

from nnkloss.ops import cpu
from cases import (centre_weight_sigma_grads, check_entry_terms_of_nan_rows,
                   check_rel_sqdist, list_case, rel_sqdist_fp64)
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
# grad_x reads the rows once, folding them into running sums (cpu_kernel.cpp).
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


# Row lengths for the second pass's column blocks (grad_pass in cpu_kernel.cpp: blocks of 16,
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
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "0")  # really 3 threads, not the governor's pick
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
def test_counted_mean_matches_the_torch_form_and_its_gradient():
    """nnk_counted_mean: the checks of the Triton launch (the same contract), on the CPU
    library's call: values against sum / count, NaN and inf rows, no counted row, the same
    bits on every call, and the mean's gradient bit for bit the torch form's."""
    from test_kernels_counted_mean import mean_checks, mean_gradient_checks
    mean_checks(cpu.counted_mean, "cpu", None)
    mean_gradient_checks(cpu.counted_mean, "cpu")


@kernel
def test_counted_mean_declines_what_it_does_not_take():
    rows, flags = torch.rand(9), torch.rand(9) > 0.5
    assert cpu.counted_mean(rows, flags) is not None
    for r, f in [(rows.half(), flags), (rows, flags.int()), (rows[:8], flags),
                 (torch.rand(9, 2)[:, 0], flags), (rows[None], flags[None]),
                 (rows.to("meta"), flags.to("meta"))]:
        assert cpu.counted_mean(r, f) is None


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


@kernel
def test_build_is_atomic_when_processes_race(tmp_path):
    cxx = cpu._compiler()
    paths, errors = [], []

    def build():
        try:
            paths.append(cpu._compile(cxx, cpu.FLAGS + cpu.THREAD_FLAGS, str(tmp_path)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    name = os.path.basename(paths[0])                   # no temporary left behind
    assert sorted(os.listdir(tmp_path)) == [name, name + ".sha256"]
    os.close(cpu._open_verified(paths[0]))              # the library matches its record


@pytest.fixture
def fresh_state():
    cpu._reset_for_tests()
    yield
    cpu._reset_for_tests()


def test_without_compiler_warns_once_and_runs_torch_path(monkeypatch, fresh_state):
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    inputs = make(seed=11)
    with pytest.warns(RuntimeWarning, match="compiled CPU kernel unavailable"):
        assert not cpu.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # the notice is given once
        out = cpu.forward(*inputs)
        grad = cpu.centre_grad(inputs[0], inputs[2], inputs[4], torch.ones(9, 7))
    from nnkloss.ops import reference as torch_path
    ref = torch_path.forward(*inputs)
    for a, b in zip(out[:4], ref[:4]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(grad, torch_path.centre_grad(inputs[0], inputs[2], inputs[4],
                                                            torch.ones(9, 7)))
    gx, g = torch.randn(4, 3), torch.tensor([1.0, 0.0, -2.0, 0.5])
    gx[1, 0] = float("nan")
    assert torch.equal(cpu.scale_rows(gx, g), torch.where((g != 0)[:, None], g[:, None] * gx, 0.0))


def test_missing_compiler_binary_is_reported(monkeypatch, fresh_state, tmp_path):
    monkeypatch.setenv("NNKLOSS_CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(no C\+\+ compiler found \(set CXX\)\); "
                                            r"using the plain PyTorch path"):
        assert not cpu.available()


def test_kernel_can_be_switched_off(monkeypatch, fresh_state):
    monkeypatch.setenv("NNKLOSS_CPU_KERNEL", "0")
    with pytest.warns(RuntimeWarning, match=r"unavailable \(disabled by NNKLOSS_CPU_KERNEL=0\)"):
        assert not cpu.available()


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
    rec = _Recorder(cpu._lib())
    monkeypatch.setattr(cpu, "_lib", lambda: rec)
    return rec


@kernel
@pytest.mark.parametrize("emb_dtype,bank_dtype,idx_dtype", [
    (torch.float32, torch.float32, torch.int64), (torch.float64, torch.bfloat16, torch.int32),
    (torch.bfloat16, torch.float16, torch.int32)])
def test_supported_inputs_run_the_compiled_kernel(recorded, emb_dtype, bank_dtype, idx_dtype,
                                                  monkeypatch):
    """The fast path is what runs (its fallback gives the same numbers, so only this tells a
    lost fast path from a working one): forward, centre_grad and scale_rows each call their
    entry point once, with the documented thread count (governor off: it may pick one)."""
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "0")
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
    assert recorded.calls[0][1][-1] == cpu._threads(B * K * D)
    assert recorded.calls[1][1][-1] == cpu._threads(B * K * D)
    assert recorded.calls[2][1][-1] == cpu._threads(B * D, cpu.SCALE_MIN_ELEMS)


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
    supported = cpu._supported(emb, centres, cl, nb, w)
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


def test_thread_count_rule(monkeypatch):
    """One thread per PARALLEL_MIN_ELEMS gathered elements, at least one, at most torch's."""
    m = cpu.PARALLEL_MIN_ELEMS
    assert m == 1 << 16
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert [cpu._threads(w) for w in (0, 1, m - 1, m, 2 * m - 1, 3 * m, 8 * m, 100 * m)] == \
        [1, 1, 1, 1, 1, 3, 8, 8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu._threads(100 * m) == 1


def test_cache_dir_follows_the_documented_variables(monkeypatch, tmp_path):
    """``$NNKLOSS_CACHE_DIR``, else ``$XDG_CACHE_HOME/nnkloss``, else ``~/.cache/nnkloss``."""
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu.cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", "")            # empty = unset
    assert cpu.cache_dir() == str(tmp_path / "xdg" / "nnkloss")
    monkeypatch.delenv("NNKLOSS_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu.cache_dir() == str(tmp_path / "home" / ".cache" / "nnkloss")


def _check_library_works(tol=1e-5):
    from nnkloss.ops import reference as torch_path
    inputs = make(seed=23)
    for a, b in zip(cpu.forward(*inputs), torch_path.forward(*inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    emb, _, centres, _, nb, _, _ = inputs
    coef = torch.rand(nb.shape)
    torch.testing.assert_close(cpu.centre_grad(emb, centres, nb, coef),
                               torch_path.centre_grad(emb, centres, nb, coef), rtol=tol, atol=tol)
    gx, g = torch.randn(4, 3), torch.tensor([1.0, 0.0, -2.0, 0.5])
    assert torch.equal(cpu.scale_rows(gx, g), g[:, None] * gx)


@kernel
def test_fresh_build_into_an_empty_cache(monkeypatch, fresh_state, tmp_path):
    """The whole first-use path, not the library this process loaded long ago: the cache
    directory is created, one keyed library lands in it, it is declared and loaded, and
    build_info reports it (each of forward, centre_grad and scale_rows then runs on it)."""
    cache = tmp_path / "a" / "cache"
    cache.mkdir(parents=True)                           # an existing, empty cache directory
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no fallback notice
        assert cpu.available()
    wall = time.perf_counter() - t0
    info = cpu.build_info()
    assert info["error"] is None
    name = os.path.basename(info["path"])
    assert sorted(os.listdir(cache)) == [name, name + ".sha256"]   # the library and its record
    assert os.path.dirname(info["path"]) == str(cache) and cpu.library_path() == info["path"]
    assert os.path.basename(info["path"]).startswith("nnk_cpu_")
    assert 0 < info["compile_s"] <= wall
    _check_library_works()
    assert cpu.available()                              # a second call reuses the library


@kernel
def test_build_falls_back_to_plain_flags_then_to_a_temp_dir(monkeypatch, fresh_state, tmp_path):
    """A compiler that refuses -fopenmp-simd gets the plain flags; an unusable cache directory
    gives way to <tmp>/nnkloss-<uid>. (``_compile`` is replaced by a stand-in that hands back
    the library already built, so no second compile is needed.)"""
    built = cpu.library_path()
    cpu._reset_for_tests()                              # forget it: the next call builds
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(blocker / "cache"))   # cannot be created
    monkeypatch.setattr(cpu.tempfile, "tempdir", str(tmp_path / "tmp"))
    out_dir = str(tmp_path / "tmp" / f"nnkloss-{os.getuid()}")
    os.makedirs(out_dir)                                # left by an earlier process
    calls = []

    def fake_compile(cxx, flags, out_dir):
        calls.append((cxx, flags, out_dir))
        for flag in ("-fopenmp", "-fopenmp-simd"):
            if flag in flags:
                raise RuntimeError(f"c++ failed: unknown flag {flag}")
        return built
    monkeypatch.setattr(cpu, "_compile", fake_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available()
    first = [cpu.OPENMP_FLAGS] if cpu.torch_libgomp() else []   # torch's OpenMP team first
    assert calls == [(cpu._compiler(), cpu.FLAGS + f, out_dir)
                     for f in first + [cpu.THREAD_FLAGS, cpu.PLAIN_FLAGS]]
    assert os.path.isdir(out_dir) and cpu.build_info()["path"] == built
    _check_library_works()


def test_build_failure_reports_every_attempt(monkeypatch, fresh_state, tmp_path):
    real_compile = cpu._compile
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(tmp_path))

    def failing(cxx, flags, out_dir):
        raise RuntimeError(f"refused {flags[-1]}")
    monkeypatch.setattr(cpu, "_compile", failing)
    attempts = ("refused -fopenmp; " if cpu.torch_libgomp() else "") + \
        "refused -fopenmp-simd; refused -pthread"
    with pytest.warns(RuntimeWarning, match=r"unavailable \(" + attempts + r"\); using the "
                                            r"plain PyTorch path"):
        assert not cpu.available()
    assert cpu.build_info() == {"path": None, "compile_s": None, "error": attempts,
                                "pool": None}
    if cpu._compiler() is not None:
        # a reset forgets the failure: the next call builds (from the cache) and says so
        monkeypatch.setattr(cpu, "_compile", real_compile)
        monkeypatch.delenv("NNKLOSS_CACHE_DIR")
        cpu._reset_for_tests()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.available()
        info = cpu.build_info()
        assert info["error"] is None and os.path.exists(info["path"]) and info["compile_s"] > 0


def _fake_compiler(path, log=None, version="fakecxx 1.0", stderr=(), write=None):
    """An executable standing in for c++: answers --version, logs its arguments one per line,
    prints ``stderr`` lines and fails, or writes ``write`` to its -o file and succeeds."""
    lines = ["#!/bin/sh",
             f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi']
    if log:
        lines.append(f'for a in "$@"; do echo "$a"; done > "{log}"')
    if write is not None:
        lines += ['out=""; prev=""',
                  'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done',
                  f'printf "{write}" > "$out"', "exit 0"]
    else:
        lines += [f'echo "{s}" >&2' for s in stderr] + ["exit 1"]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return str(path)


def test_compiler_lookup_order(monkeypatch, tmp_path):
    """``$NNKLOSS_CXX``, then ``$CXX``, then c++, g++, clang++ on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("mine", "theirs", "c++", "g++", "clang++"):
        _fake_compiler(bin_dir / name)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("NNKLOSS_CXX", "mine")
    monkeypatch.setenv("CXX", "theirs")
    assert cpu._compiler() == str(bin_dir / "mine")
    monkeypatch.delenv("NNKLOSS_CXX")
    assert cpu._compiler() == str(bin_dir / "theirs")
    monkeypatch.delenv("CXX")
    for name in ("c++", "g++", "clang++"):
        assert cpu._compiler() == str(bin_dir / name)
        (bin_dir / name).unlink()
    assert cpu._compiler() is None


def test_cpu_flags_are_the_feature_list():
    """The CPU's feature list keys the cache (-march=native code must not be loaded on another
    CPU): the flags of /proc/cpuinfo on Linux, without the field name."""
    flags = cpu._cpu_flags()
    assert ":" not in flags and flags == flags.strip()
    if os.path.exists("/proc/cpuinfo") and cpu.platform.machine() == "x86_64":
        assert "sse2" in flags.split()             # every x86-64 CPU has it


def test_cache_key_follows_compiler_version_and_flags(tmp_path):
    a = _fake_compiler(tmp_path / "a", version="fakecxx 1.0")
    key = cpu._cache_key(a, cpu.FLAGS)
    assert len(key) == 20 and int(key, 16) >= 0
    assert cpu._cache_key(a, cpu.FLAGS) == key                     # deterministic
    assert cpu._cache_key(a, cpu.FLAGS + ["-g"]) != key            # flags
    _fake_compiler(tmp_path / "a", version="fakecxx 2.0")
    assert cpu._cache_key(a, cpu.FLAGS) != key                     # compiler version
    missing = cpu._cache_key(str(tmp_path / "none"), cpu.FLAGS)    # no --version: still a key
    assert len(missing) == 20


def test_compile_stages_a_hidden_file_and_reports_the_error_line(tmp_path):
    """The compiler writes to a hidden ``.nnk_cpu_*.so`` beside the target, renamed into place
    on success and removed on failure; a failure names the compiler and its first stderr line
    with "error" (else its last line)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    log = tmp_path / "args"
    bad = _fake_compiler(tmp_path / "fakecxx", log=log,
                         stderr=["note: a", "note: b", "error: boom"])
    with pytest.raises(RuntimeError, match=r"^fakecxx failed: error: boom$"):
        cpu._compile(bad, cpu.FLAGS, str(out_dir))
    args = log.read_text().splitlines()
    assert args[:len(cpu.FLAGS)] == cpu.FLAGS and args[-3:-1] == [cpu.SOURCE, "-o"]
    staged = args[-1]
    assert os.path.dirname(staged) == str(out_dir)
    assert os.path.basename(staged).startswith(".nnk_cpu_") and staged.endswith(".so")
    assert os.listdir(out_dir) == []                               # staging file removed

    silent = _fake_compiler(tmp_path / "quiet", stderr=[])
    with pytest.raises(RuntimeError, match=r"^quiet failed: \?$"):
        cpu._compile(silent, cpu.FLAGS, str(out_dir))
    # GCC's shape: the error line, then the source line and its caret line
    gcc = _fake_compiler(tmp_path / "gcclike", stderr=[
        "k.cpp: In function 'void f()':", "k.cpp:3:5: error: 'y' was not declared",
        "    3 |     y = 1;", "      |     ^", "k.cpp:4:5: error: second"])
    with pytest.raises(RuntimeError,
                       match=r"^gcclike failed: k.cpp:3:5: error: 'y' was not declared$"):
        cpu._compile(gcc, cpu.FLAGS, str(out_dir))
    warned = _fake_compiler(tmp_path / "warned", stderr=["warning: a", "collect2: ld returned 1"])
    with pytest.raises(RuntimeError, match=r"^warned failed: collect2: ld returned 1$"):
        cpu._compile(warned, cpu.FLAGS, str(out_dir))

    good = _fake_compiler(tmp_path / "good", write="ELF")
    path = cpu._compile(good, cpu.FLAGS, str(out_dir))
    assert path == str(out_dir / f"nnk_cpu_{cpu._cache_key(good, cpu.FLAGS)}.so")
    name = os.path.basename(path)
    assert sorted(os.listdir(out_dir)) == [name, name + ".sha256"]
    with open(path) as f:
        assert f.read() == "ELF"
    assert os.stat(path).st_mode & 0o777 == 0o755
    record = open(path + ".sha256").read()
    assert record == __import__("hashlib").sha256(b"ELF").hexdigest() + "\n"
    inode = os.stat(path).st_ino
    assert cpu._compile(good, cpu.FLAGS, str(out_dir)) == path     # verified: reused
    assert os.stat(path).st_ino == inode                           # (a rebuild renames anew)
    # A library changed after its build (here: rewritten) no longer matches its record: it is
    # rebuilt, never reused (before issue 18 this test asserted the opposite).
    with open(path, "w") as f:
        f.write("OLD")
    assert cpu._compile(good, cpu.FLAGS, str(out_dir)) == path
    with open(path) as f:
        assert f.read() == "ELF"


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
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "0")  # the rule alone, not the governor's pick
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
    monkeypatch.setattr(cpu, "_lib", lambda: fail)
    emb, labels, centres, cl, nb, w, s = make(seed=27)
    with pytest.raises(RuntimeError, match=r"^nnk_forward failed \(code 3\)$"):
        cpu.forward(emb, labels, centres, cl, nb, w, s)
    with pytest.raises(RuntimeError, match=r"^nnk_centre_grad failed \(code 4\)$"):
        cpu.centre_grad(emb, centres, nb, torch.ones(nb.shape))
    with pytest.raises(RuntimeError, match=r"^nnk_scale_rows failed \(code 5\)$"):
        cpu.scale_rows(torch.randn(3, 2), torch.ones(3))


# ---------------------------------------------------------------- nothing loaded unchecked
# (issue 18). A stand-in compiler that copies a given library to its -o file makes a "build"
# instant, so these tests can build as often as they need, in fresh processes too.

def _copy_compiler(path, lib, log=None):
    lines = ["#!/bin/sh", 'if [ "$1" = "--version" ]; then echo "copycxx 1.0"; exit 0; fi']
    if log:
        lines.append(f'echo built >> "{log}"')
    lines += ['out=""; prev=""',
              'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done',
              f'cp "{lib}" "$out"']
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return str(path)


def _key_path(cache, cxx, flags=None):
    key = cpu._cache_key(cxx, flags or cpu.FLAGS + cpu.flag_choices()[0])
    return os.path.join(str(cache), f"nnk_cpu_{key}.so")


def _record(path):
    import hashlib
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(path + ".sha256", "w") as f:
        f.write(digest + "\n")


def _in_fresh_process(code, env_extra, timeout=240):
    """Run ``code`` in a new interpreter (a SIGBUS or a foreign constructor there shows as a
    failed test, not a dead pytest)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=root)


def _compile_c(tmp_path, name, source):
    c = tmp_path / f"{name}.c"
    c.write_text(source)
    out = tmp_path / f"{name}.so"
    import subprocess
    subprocess.run([cpu._compiler(), "-shared", "-fPIC", "-x", "c", str(c), "-o", str(out)],
                   check=True, capture_output=True)
    return str(out)


_REPORT = ("import warnings, json\n"
           "warnings.simplefilter('ignore')\n"
           "from nnkloss.ops import cpu\n"
           "print(json.dumps([cpu.available(), cpu.build_info()]))\n")


@kernel
def test_truncated_library_is_rebuilt_never_loaded(tmp_path):
    """Cut to 25/50/75 % (what a power loss before the rename could leave, with or without its
    record), the cached library is rebuilt; before issue 18 ctypes mapped it and the process
    died of SIGBUS."""
    real = cpu.library_path()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cxx = _copy_compiler(tmp_path / "copycxx", real)
    target = _key_path(cache, cxx)
    data = open(real, "rb").read()
    code = ("import warnings, json, os\n"
            "warnings.simplefilter('ignore')\n"
            "from nnkloss.ops import cpu\n"
            "out = []\n"
            f"target, data = {target!r}, open({real!r}, 'rb').read()\n"
            "for frac, keep_record in ((0.25, True), (0.5, False), (0.75, True)):\n"
            "    cpu._reset_for_tests()\n"
            # a new file: cutting the one the last trial loaded would hit its live mapping
            "    os.unlink(target)\n"
            "    with open(target, 'wb') as f:\n"
            "        f.write(data[:int(len(data) * frac)])\n"
            "    if not keep_record and os.path.exists(target + '.sha256'):\n"
            "        os.unlink(target + '.sha256')\n"
            "    out.append([cpu.available(), open(target, 'rb').read() == data])\n"
            "print(json.dumps(out))\n")
    with open(target, "wb") as f:
        f.write(data)
    _record(target)                                   # the record of the complete library
    proc = _in_fresh_process(code, {"NNKLOSS_CACHE_DIR": str(cache), "NNKLOSS_CXX": cxx})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    import json
    assert json.loads(proc.stdout.splitlines()[-1]) == [[True, True]] * 3


@kernel
def test_planted_library_in_a_shared_cache_never_runs(tmp_path):
    """A world-writable cache directory (or one owned by someone else) is not used: a library
    planted there under the computable key, with a matching record, never runs its
    constructor; the kernel is built in the private fallback directory instead."""
    real = cpu.library_path()
    marker = tmp_path / "pwned"
    evil = _compile_c(tmp_path, "evil", "#include <stdio.h>\n"
                      "__attribute__((constructor)) static void run(void) {\n"
                      f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    cxx = _copy_compiler(tmp_path / "copycxx", real)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                               # like a shared /tmp directory
    planted = _key_path(shared, cxx)
    import shutil
    shutil.copy(evil, planted)
    _record(planted)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _in_fresh_process(_REPORT, {"NNKLOSS_CACHE_DIR": str(shared), "NNKLOSS_CXX": cxx,
                                       "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not marker.exists()
    import json
    ok, info = json.loads(proc.stdout.splitlines()[-1])
    assert ok and os.path.dirname(info["path"]) == str(tmp / f"nnkloss-{os.getuid()}")


@kernel
@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file owned by another user needs root")
def test_foreign_library_or_directory_is_refused(tmp_path):
    """A library (or its record) owned by another user is rebuilt, even in our own private
    directory; a cache directory owned by another user is not used at all."""
    real = cpu.library_path()
    marker = tmp_path / "pwned"
    evil = _compile_c(tmp_path, "evil", "#include <stdio.h>\n"
                      "__attribute__((constructor)) static void run(void) {\n"
                      f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    cxx = _copy_compiler(tmp_path / "copycxx", real)
    import shutil
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = _key_path(cache, cxx)
    shutil.copy(evil, planted)
    _record(planted)
    os.chown(planted, 65534, 65534)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    shutil.copy(evil, _key_path(theirs, cxx))
    _record(_key_path(theirs, cxx))
    os.chown(theirs, 65534, 65534)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    import json
    for d, where in ((cache, cache), (theirs, tmp / f"nnkloss-{os.getuid()}")):
        proc = _in_fresh_process(_REPORT, {"NNKLOSS_CACHE_DIR": str(d), "NNKLOSS_CXX": cxx,
                                           "TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        ok, info = json.loads(proc.stdout.splitlines()[-1])
        assert ok and os.path.dirname(info["path"]) == str(where)
        assert not marker.exists()
    assert os.stat(planted).st_uid == os.geteuid()            # replaced by our own build
    assert open(planted, "rb").read() == open(real, "rb").read()


@kernel
def test_writable_library_is_rebuilt(monkeypatch, fresh_state, tmp_path):
    """A library of ours that group or others may write to is not trusted: rebuilt."""
    real = cpu.library_path()
    log = tmp_path / "log"
    cxx = _copy_compiler(tmp_path / "copycxx", real, log=log)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = _key_path(cache, cxx)
    import shutil
    shutil.copy(real, target)
    _record(target)
    os.chmod(target, 0o777)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    monkeypatch.setenv("NNKLOSS_CXX", cxx)
    cpu._reset_for_tests()                              # forget the library found above
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available()
    assert log.read_text().splitlines() == ["built"]
    assert os.stat(target).st_mode & 0o777 == 0o755
    _check_library_works()


def test_no_private_cache_directory_runs_the_plain_path(monkeypatch, fresh_state, tmp_path):
    """Neither the configured directory nor <tmp>/nnkloss-<uid> private: a one-line warning
    naming both and why, then the plain path (nothing built, nothing loaded)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(shared))
    monkeypatch.setattr(cpu.tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback = tmp_path / "tmp" / f"nnkloss-{os.getuid()}"
    fallback.mkdir(parents=True)
    fallback.chmod(0o775)
    monkeypatch.setattr(cpu, "_compile", lambda *a: pytest.fail("must not build"))
    with pytest.warns(RuntimeWarning, match=r"no private cache directory \(.*shared is writable "
                                            r"by group or others \(mode 0o777\); .*nnkloss-\d+ is "
                                            r"writable by group or others"):
        assert not cpu.available()
    inputs = make(seed=11)
    from nnkloss.ops import reference as torch_path
    for a, b in zip(cpu.forward(*inputs)[:4], torch_path.forward(*inputs)[:4]):
        torch.testing.assert_close(a, b)


def test_missing_cache_directory_is_created_private(tmp_path):
    d = tmp_path / "a" / "b"
    assert cpu._private_dir(str(d)) == str(d)
    assert os.stat(d).st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        cpu._private_dir(str(tmp_path / "file"))


@kernel
def test_library_without_the_kernel_symbols_falls_back(monkeypatch, fresh_state, tmp_path):
    """A library that loads but lacks an entry point: each flag set is tried, and the failure
    is the one-line warning, not an AttributeError (which used to skip the second attempt)."""
    empty = _compile_c(tmp_path, "empty", "int nothing_here(void) { return 0; }\n")
    cxx = _copy_compiler(tmp_path / "copycxx", empty)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    monkeypatch.setenv("NNKLOSS_CXX", cxx)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(.*nnk_forward.*; .*nnk_forward.*\); "
                                            r"using the plain PyTorch path"):
        assert not cpu.available()


def test_library_is_fsynced_before_the_rename(monkeypatch, tmp_path):
    """The bytes reach the disk before the name: fsync of the staged file, then os.replace."""
    good = _fake_compiler(tmp_path / "good", write="ELF")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a)))
        return real_replace(a, b)
    monkeypatch.setattr(cpu.os, "fsync", fsync)
    monkeypatch.setattr(cpu.os, "replace", replace)
    cpu._compile(good, cpu.FLAGS, str(tmp_path))
    staged = [e for e in events if e[1].endswith(".so") and "/.nnk_cpu_" in e[1]]
    assert staged[0][0] == "fsync" and staged[1] == ("replace", staged[0][1])


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


def test_first_build_says_so_once(monkeypatch, fresh_state, caplog):
    """A compile (slow) gives one log line per process; a cached load (fast) gives none."""
    import logging
    monkeypatch.setattr(cpu, "_build_and_load", lambda: (
        cpu._state.update(path="/cache/x/nnk_cpu_1.so", compile_s=6.5), object())[1])
    with caplog.at_level(logging.INFO, logger="nnkloss"):
        cpu._lib()
        cpu._lib()
        cpu.available()
    lines = [r.getMessage() for r in caplog.records if r.name == "nnkloss"]
    assert lines == ["nnkloss: compiled the CPU kernel in 6.5 s (once per machine; cached in "
                     "/cache/x)"]
    cpu._reset_for_tests()
    monkeypatch.setattr(cpu, "_build_and_load", lambda: (
        cpu._state.update(path="/cache/x/nnk_cpu_1.so", compile_s=0.01), object())[1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nnkloss"):
        cpu._lib()
    assert [r for r in caplog.records if r.name == "nnkloss"] == []


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_cpu_library_is_built_once_per_process(monkeypatch):
    """Kills ops.cpu _lib 15-18 (the "tried" flag not set: every call rebuilt and reloaded
    the library)."""
    import warnings
    from nnkloss.ops import cpu
    builds = []
    real = cpu._build_and_load

    def counting():
        builds.append(1)
        return real()
    monkeypatch.setattr(cpu, "_build_and_load", counting)
    cpu._reset_for_tests()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # no compiler: the notice is not the point
            first = cpu.available()
            assert [cpu.available() for _ in range(3)] == [first] * 3
    finally:
        cpu._reset_for_tests()
    assert builds == [1]


# -----------------------------------------------------------------------------------------------
# The symmetric self-search's selection (nnk_knn_select_sym, KnnSelection.add_symmetric; issue
# 21): tiles (I, J), J >= I, of square blocks, fed to rows and, off the diagonal, to columns.

def _sym_lists(m, s, k, cap, threads_min_elems=None, monkeypatch=None):
    """Feed the (n, n) matrix ``m`` to a state of n points as the symmetric search does: only
    tiles (I, J) with J >= I, I outer, J inner; each block finished after its row of tiles."""
    n = m.shape[0]
    sel = cpu.knn_selection(n, k, cap)
    sel.reset(n)
    dist, idx = [], []
    for i0 in range(0, n, s):
        rows = min(s, n - i0)
        for j0 in range(i0, n, s):
            sel.add_symmetric(m[i0:i0 + rows, j0:j0 + s].contiguous(), i0, j0)
        d, i = sel.finish(i0, rows)
        dist.append(d)
        idx.append(i)
    return torch.cat(dist), torch.cat(idx)


def _effective(m, s):
    """What the symmetric search ranks: pair (p, q) with block(p) <= block(q) takes m[p, q],
    computed with p on the query side; the other order takes m[q, p] (the tile above the
    diagonal, read down its column). Inside a diagonal block both orders are in the tile."""
    blk = torch.arange(m.shape[0]) // s
    upper = blk[:, None] <= blk[None, :]
    return torch.where(upper, m, m.t())


@kernel
@pytest.mark.parametrize("n,s", [(100, 16), (101, 16), (70, 40), (33, 33), (10, 16), (97, 1),
                                 (300, 128), (450, 200)])
@pytest.mark.parametrize("k,extra", [(1, 1), (5, 64), (9, 2)])
def test_symmetric_selection_matches_sorted_reference(n, s, k, extra):
    """A NON-symmetric matrix of small integers (many ties, -0.0 and negatives that clamp to 0):
    every point's list is the (distance, index) sort of its row of the effective matrix, so a
    column side that read the wrong entry, skipped a candidate or broke the order would show.
    Column groups (items) are 128 columns with AVX-512, 64 with AVX2: blocks of 128 and 200
    have full groups (the vector path) and 200 a partial one, smaller blocks only partial
    ones (the scalar path); N not a multiple of S, N < S, S = 1; cap = k + 1 compacts on
    nearly every push."""
    k = min(k, n)
    g = torch.Generator().manual_seed(n * 7 + s + k)
    m = torch.randint(0, 6, (n, n), generator=g).float()
    m[torch.rand(n, n, generator=g) < 0.05] = -0.0
    m[torch.rand(n, n, generator=g) < 0.05] = -1e-6
    ref_d, ref_i = (_effective(m, s).clamp_min(0.0) + 0.0).sort(dim=1, stable=True)
    d, i = _sym_lists(m, s, k, k + extra)
    assert i.dtype == torch.int64 and d.dtype == torch.float32
    assert torch.equal(i, ref_i[:, :k])
    assert torch.equal(d.view(torch.int32), ref_d[:, :k].view(torch.int32))


@kernel
@pytest.mark.parametrize("s", [16, 5, 200])
def test_symmetric_selection_returns_every_point_when_k_is_n(s):
    """k = N (own row included): each list is a permutation of all points, inf distances too
    (a lane takes every value until its first compaction, whatever it is), on the scalar and
    the vector column path (tile (0, 1) of 200 x 200 holds a full group of columns)."""
    n = 400
    g = torch.Generator().manual_seed(s)
    m = torch.randint(0, 4, (n, n), generator=g).float()
    m[torch.rand(n, n, generator=g) < 0.1] = float("inf")
    ref_d, ref_i = _effective(m, s).sort(dim=1, stable=True)
    d, i = _sym_lists(m, s, n, n + 1)
    assert torch.equal(i, ref_i) and torch.equal(d, ref_d)


@kernel
def test_symmetric_selection_is_the_same_on_two_threads(monkeypatch):
    """Rows and columns of one tile are shared out to the threads together (disjoint state
    rows): the lists do not depend on the thread count."""
    g = torch.Generator().manual_seed(5)
    m = torch.randint(0, 50, (300, 300), generator=g).float()
    one = _sym_lists(m, 64, 20, 84)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cpu._threads(2 * 64 * 64) == 2
    two = _sym_lists(m, 64, 20, 84)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@kernel
def _selection_lists(lib, dist, k, cap, widths):
    """The lists of KnnSelection on ``lib`` fed the (rows, n) tile ``dist`` in column tiles of
    the given widths (cycled)."""
    rows, n = dist.shape
    sel = cpu.KnnSelection(lib, rows, k, cap)
    sel.reset(rows)
    c0, t = 0, 0
    while c0 < n:
        w = widths[t % len(widths)]
        sel.add(dist[:, c0:c0 + w].contiguous(), c0)
        c0, t = c0 + w, t + 1
    return sel.finish()


@kernel
@pytest.mark.skipif(os.uname().machine != "x86_64" or "avx2" not in cpu._cpu_flags().split(),
                    reason="an x86-64-v3 build needs an x86-64 CPU with AVX2")
def test_selection_is_exact_in_an_avx2_build_too(tmp_path, monkeypatch):
    """The selection's AVX-512 paths (the keys of a chunk as vectors, the compactions' counted
    pivots, the eight-key count and partition) have AVX2 / scalar counterparts that the native
    build of an AVX-512 machine never runs: an x86-64-v3 build (benchmarks/cpu_variants.py's
    verified build with other flags) gives the lists of the (distance, index) sort, as the
    native one does, with buffers compacted by nth_element (k 83) and by a sampled pivot
    (k 600), on ties, -0.0, negatives and inf."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import cpu_variants
    native = cpu._lib()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        avx2 = cpu_variants.build("-march=x86-64-v3,!-march=native")
    finally:
        cpu._reset_for_tests()  # the next caller loads the native build again
    assert avx2 is not native
    g = torch.Generator().manual_seed(83)
    for k, n in ((83, 997), (600, 7 * 600)):
        dist = torch.randint(0, 40, (4, n), generator=g).float()
        dist[0, 100:140] = -0.0
        dist[1, ::7] = -1e-6
        dist[2, n - 50:] = float("inf")
        dist[3] = torch.rand(n, generator=g)
        ref_d, ref_i = (dist.clamp_min(0.0) + 0.0).sort(dim=1, stable=True)
        cap = k + max(k, 64)
        for lib in (native, avx2):
            d, i = _selection_lists(lib, dist, k, cap, [37, 16, 250, 1])
            assert torch.equal(i, ref_i[:, :k])
            assert torch.equal(d.view(torch.int32), ref_d[:, :k].view(torch.int32))


def test_symmetric_selection_rejects_bad_tiles():
    sel = cpu.knn_selection(40, 3, 70)
    sel.reset(40)
    tile = torch.zeros(10, 10)
    with pytest.raises(RuntimeError, match=r"nnk_knn_select_sym failed \(code 2\)"):
        sel.add_symmetric(tile, 0, 5)  # overlapping blocks that are not the diagonal
    with pytest.raises(RuntimeError, match=r"nnk_knn_select_sym failed \(code 2\)"):
        sel.add_symmetric(torch.zeros(10, 5), 0, 0)  # not square on the diagonal
    with pytest.raises(ValueError, match="exceed the 40 points"):
        sel.add_symmetric(tile, 0, 35)
    with pytest.raises(ValueError, match="dist must be an fp32"):
        sel.add_symmetric(tile.double(), 0, 10)
    with pytest.raises(ValueError, match="outside the state"):
        sel.finish(35, 10)
    bad = cpu.knn_selection(40, 4, 4)  # cap must exceed k
    bad.reset(40)
    with pytest.raises(RuntimeError, match=r"nnk_knn_select_sym failed \(code 2\)"):
        bad.add_symmetric(tile, 0, 10)


@kernel
def test_selection_refuses_tiles_it_would_read_or_write_past():
    """KnnSelection.add passed dist's pointer, its row stride and col0 to the library
    unchecked: a tile of more rows than the state (or an add before reset, on uninitialised
    counts) wrote keys past the state's buffers (a segfault, hence the fresh process), an
    fp16 tile was read past its end, a strided or transposed one read as the wrong values,
    and a col0 out of range failed as 'code 2' naming nothing."""
    code = ("import torch\nfrom nnkloss.ops import cpu\nsel = cpu.knn_selection(4, 3, 8)\n"
            "sel.reset(4)\ntry:\n    sel.add(torch.rand(5000, 40), 0)\n"
            "except ValueError as e:\n    print(e)\n")
    run = _in_fresh_process(code, {})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "dist has 5000 rows but the selection was reset to 4 rows" in run.stdout
    sel = cpu.knn_selection(4, 3, 8)
    d = torch.rand(4, 40, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^dist has 4 rows but the selection was reset to 0"):
        sel.add(d, 0)  # no reset yet
    with pytest.raises(ValueError, match=r"^rows must be in \[0, 4\]"):
        sel.reset(5)
    sel.reset(4)
    for bad in (d.half(), d.double(), torch.rand(4, 80)[:, ::2], torch.rand(40, 4).t(),
                d.to("meta")):
        with pytest.raises(ValueError, match=r"^dist must be an fp32 CPU tile with unit column"):
            sel.add(bad, 0)
    with pytest.raises(ValueError, match=r"^dist must be a 2-D"):
        sel.add(d[0], 0)
    with pytest.raises(ValueError, match=r"^dist has 2 rows"):
        sel.add(d[:2], 0)
    with pytest.raises(ValueError, match=r"^col0 must be >= 0, got -3"):
        sel.add(d, -3)
    with pytest.raises(ValueError, match=r"^col0 must be in \[0, 2\*\*32 - 40\]"):
        sel.add(d, 2**32 - 39)  # the last index would not fit a key's 32 bits
    with pytest.raises(TypeError, match=r"^col0 must be an int"):
        sel.add(d, 1.0)
    sel.add(d[:, :20], 0)
    with pytest.raises(ValueError, match=r"^col0 must be in \[20, "):
        sel.add(d[:, 20:], 10)  # overlaps the columns already folded in
    sel.add(d[:, 20:], 20)  # a column slice (row stride 40 > 20 columns) is read in place
    dist, idx = sel.finish()
    want = d.topk(3, largest=False)
    assert torch.equal(idx, want.indices) and torch.equal(dist, want.values)
    sel.reset(4)  # a reset starts the column order again
    sel.add(d, 0)
    with pytest.raises(ValueError, match=r"^row0 must be >= 0"):
        sel.add_symmetric(torch.zeros(2, 2), -2, 2)  # was an offset before the state


@kernel
@pytest.mark.parametrize("k", [4, 1])
def test_finish_drops_the_own_index_as_drop_self_does(k):
    """KnnSelection.finish(self0=...) drops each row's own index in the decode
    (nnk_knn_unkey): the lists of drop_self applied to the k + 1 of a plain finish, bit for
    bit, with the own index first, inside, last (rank k + 1), absent behind more than k exact
    ties of lower index (the last entry goes), and far away."""
    from nnkloss.bank.search import drop_self
    g = torch.Generator().manual_seed(97)
    rows, n, self0 = 7, 60, 10
    dist = torch.randint(1, 30, (rows, n), generator=g).float()
    own = torch.arange(self0, self0 + rows)
    r = torch.arange(rows)
    dist[r, own] = 5.0
    dist[0, own[0]] = 0.0                  # first
    dist[1, :k + 3] = 0.0                  # k + 3 ties of lower index ahead of the own one
    dist[1, own[1]] = 0.0
    dist[2, own[2]] = 0.5                  # inside: below every other distance but one
    dist[2, 40] = 0.25
    dist[3, 20:20 + k] = 0.5               # last of the k + 1
    dist[3, own[3]] = 0.75
    dist[4, own[4]] = 1e6                  # far: not among the k + 1
    sels = [cpu.knn_selection(rows, k + 1, k + 1 + 64) for _ in range(2)]
    for sel in sels:
        sel.reset(rows)
        for c0 in range(0, n, 13):
            sel.add(dist[:, c0:c0 + 13].contiguous(), c0)
    plain_d, plain_i = sels[0].finish()
    assert plain_i.shape == (rows, k + 1)
    ref_d, ref_i = drop_self(plain_d, plain_i, own, k)
    d, i = sels[1].finish(self0=self0)
    assert i.shape == (rows, k) and d.shape == (rows, k)
    assert torch.equal(i, ref_i) and torch.equal(d.view(torch.int32), ref_d.view(torch.int32))
    assert not (i[[0, 2, 3, 4, 5, 6]] == own[[0, 2, 3, 4, 5, 6], None]).any()
    assert (i[1] < own[1]).all()  # absent behind its ties: the first k kept
    with pytest.raises(ValueError, match="self0 must be >= 0"):
        sels[1].finish(self0=-1)
    one = cpu.knn_selection(rows, 1, 65)
    one.reset(rows)
    with pytest.raises(ValueError, match="k >= 2"):
        one.finish(self0=0)
    # the library refuses a decode that would read past the buffer: k + 1 keys need cap > k
    keys = torch.zeros(1, 4, dtype=torch.int64)
    out_d, out_i = torch.empty(1, 4), torch.empty(1, 4, dtype=torch.int64)
    assert cpu._lib().nnk_knn_unkey(1, 4, 4, keys.data_ptr(), out_d.data_ptr(),
                                    out_i.data_ptr(), 0, 1) == 2
    assert cpu._lib().nnk_knn_unkey(1, 4, 4, keys.data_ptr(), out_d.data_ptr(),
                                    out_i.data_ptr(), -1, 1) == 0


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
        monkeypatch.setattr(cpu, "_threads", lambda work, min_elems=None: threads)
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


def _list_overlap_sets(new, old):
    """The definition: per row, the new entries >= 0 that the old row holds, each counted."""
    return torch.tensor([sum(1 for j in a.tolist() if j >= 0 and j in set(b.tolist()))
                         for a, b in zip(new, old, strict=True)], dtype=torch.int64)


@kernel
@pytest.mark.parametrize("new_dtype", INDEX, ids=str)
@pytest.mark.parametrize("old_dtype", INDEX, ids=str)
def test_list_overlap_counts_the_shared_entries(new_dtype, old_dtype, monkeypatch):
    """nnk_list_overlap: padding never shared, a repeated new entry counted each time, lists
    of different lengths, rows that share all, none, and the bitmap's word edges (63, 64);
    the refresh's torch form gives the same counts."""
    g = torch.Generator().manual_seed(21)
    n, kn, ko = 130, 11, 7
    new = torch.randint(0, n, (n, kn), generator=g)
    old = torch.randint(0, n, (n, ko), generator=g)
    new[torch.rand(n, kn, generator=g) < 0.2] = -1
    old[torch.rand(n, ko, generator=g) < 0.2] = -1
    new[0, :ko] = old[0]                 # shares everything the old row holds
    new[1] = -1                          # all padding
    old[2] = -1                          # nothing to share
    new[3], old[3] = 5, 5                # one entry, repeated: counted kn times
    new[4, :3] = torch.tensor([63, 64, 0])
    old[4, :3] = torch.tensor([64, 63, 127])
    new[5, :3] = torch.tensor([129, 128, 127])
    old[5] = torch.tensor([129, 127, -1, -1, 0, 1, 2])
    got, listed = cpu.list_overlap(new.to(new_dtype), old.to(old_dtype), n)
    want = _list_overlap_sets(new, old)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(listed, (new >= 0).sum(1))
    assert got[3] == kn and got[1] == 0 and got[2] == 0 and got[4] >= 2 and got[5] >= 2
    assert 0 < int(got.sum()) < int((new >= 0).sum())
    # the refresh's statistic, by the library and by its torch form
    from nnkloss.bank import refresh
    valid = (new >= 0).sum(1).clamp_min(1)
    assert refresh._list_overlap(new, old) == pytest.approx(float((want / valid).mean()))
    monkeypatch.setattr(cpu, "list_overlap", lambda *args: None)
    assert refresh._list_overlap(new, old) == pytest.approx(float((want / valid).mean()))
    monkeypatch.undo()
    assert cpu.list_overlap(new[:0], old[:0], n)[0].shape == (0,)


@kernel
def test_list_overlap_leaves_what_it_does_not_take_to_the_torch_form():
    new, old = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 2], [3, -1]])
    assert [t.tolist() for t in cpu.list_overlap(new, old, 4)] == [[1, 1], [2, 2]]
    for bad in (4, -2):  # an entry outside [-1, rows): not counted here
        far = old.clone()
        far[1, 1] = bad
        assert cpu.list_overlap(new, far, 4) is None
        assert cpu.list_overlap(far, new, 4) is None
    assert cpu.list_overlap(new, old[:1], 4) is None  # different row counts
    assert cpu.list_overlap(new.t().contiguous().t(), old, 4) is None
    assert cpu.list_overlap(new.float(), old, 4) is None


@kernel
def test_list_overlap_refuses_a_bitmap_size_it_cannot_make():
    """num_rows sizes the library's bitmap: a negative one became a size_t of about 2**64
    (std::length_error through the C interface: the process aborted, hence the fresh
    process), one too large to allocate threw std::bad_alloc the same way."""
    code = ("import torch\nfrom nnkloss.ops import cpu\n"
            "new, old = torch.tensor([[0, 1]]), torch.tensor([[1, -1]])\n"
            "for m in (-1000, 2**62):\n    try:\n        cpu.list_overlap(new, old, m)\n"
            "    except (ValueError, MemoryError) as e:\n        print(type(e).__name__, e)\n")
    run = _in_fresh_process(code, {})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ValueError num_rows must be >= 0, got -1000" in run.stdout
    assert "MemoryError list_overlap: no memory for a bitmap of num_rows=4611686018427387904" \
        in run.stdout
    new, old = torch.tensor([[0, 1]]), torch.tensor([[1, -1]])
    with pytest.raises(ValueError, match=r"^num_rows must be >= 0, got -1$"):
        cpu.list_overlap(new, old, -1)
    with pytest.raises(TypeError, match=r"^num_rows must be an int"):
        cpu.list_overlap(new, old, 2.0)
    shared, listed = cpu.list_overlap(new[:, :0], old[:, 1:], 0)  # num_rows 0, padding only
    assert shared.tolist() == [0] and listed.tolist() == [0]
    assert cpu.list_overlap(new, old, 0) is None  # entries outside [-1, 0): the torch form


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
    monkeypatch.setattr(cpu, "_threads", lambda work, min_elems=None: 2)
    big_idx = torch.randint(0, 30, (300, 8), generator=g)
    xs = torch.randn(300, 6, generator=g)
    two = cpu.rel_sqdist(xs, centres, big_idx, big_idx[:, 1], torch.float32)
    monkeypatch.setattr(cpu, "_threads", lambda work, min_elems=None: 1)
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


# ------------------------------------------------------------------ the kNN search's GEMM
def _has_gemm() -> bool:
    return cpu.gemm_nt(torch.zeros(1, 1), torch.zeros(1, 1), torch.empty(1, 1))


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


gemm = pytest.mark.skipif(not (cpu.available() and _has_gemm()),
                          reason="no compiled GEMM (no C++ compiler or no AVX-512)")


@kernel
def test_gemm_is_there_exactly_where_the_build_has_avx512():
    """nnk_gemm_nt answers 1 (not built: the caller keeps torch.mm) only without AVX-512; a
    -march=native build on a CPU with avx512f has it."""
    assert _has_gemm() == _avx512()


@gemm
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 13, 5), (8, 32, 8), (9, 33, 136),
                                   (33, 65, 72), (100, 31, 200), (3, 70, 1), (5, 40, 0)])
def test_gemm_matches_fp64(m, n, k):
    """Every tail (rows past a panel of 8, columns past 32) and k = 0 (zeros); against fp64,
    within k rounding errors of the terms' magnitudes; exact on small integers."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out = torch.full((m, n), float("nan"))
    assert cpu.gemm_nt(a, b, out)
    ref = a.double() @ b.double().t()
    scale = a.double().abs() @ b.double().abs().t()
    assert ((out.double() - ref).abs() <= (k + 1) * 2.0 ** -24 * scale).all()
    ai = torch.randint(-8, 9, (m, k), generator=g).float()
    bi = torch.randint(-8, 9, (n, k), generator=g).float()
    assert cpu.gemm_nt(ai, bi, out)
    assert torch.equal(out, (ai.double() @ bi.double().t()).float())


@gemm
def test_gemm_bits_do_not_depend_on_the_tile_the_strides_or_the_threads():
    """An element is one dot product of its two rows: the same bits computed in a whole tile,
    in any sub-tile (other panel boundaries), through row-strided views, and at 1 or 2
    threads. (A BLAS gives no such promise: the search's paths rely on this one.)"""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(300, 136, generator=g) * 50, torch.randn(517, 136, generator=g)
    whole = torch.empty(300, 517)
    assert cpu.gemm_nt(a, b, whole)
    for r0, r1, c0, c1 in [(3, 250, 5, 517), (1, 2, 0, 1), (7, 300, 31, 100), (0, 17, 33, 66)]:
        part = torch.empty(r1 - r0, c1 - c0)
        assert cpu.gemm_nt(a[r0:r1], b[c0:c1], part)
        assert torch.equal(part, whole[r0:r1, c0:c1])
    # row-strided inputs (the first 136 of 200 columns) and output (a window of a wider buffer)
    wa = torch.zeros(300, 200)
    wa[:, :136] = a
    buf = torch.full((300, 600), -1.0)
    assert cpu.gemm_nt(wa[:, :136], b, buf[:, 40:557])
    assert torch.equal(buf[:, 40:557], whole)
    assert (buf[:, :40] == -1).all() and (buf[:, 557:] == -1).all(), "wrote outside the view"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty(300, 517)
        assert cpu.gemm_nt(a, b, one)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, whole)


@kernel
def test_gemm_declines_what_it_cannot_read():
    """Other dtypes, column strides, shapes that do not match, and rows that overlap: False
    (the caller's torch.mm runs), nothing written."""
    a, b = torch.randn(4, 6), torch.randn(5, 6)
    out = torch.full((4, 5), 7.0)
    for args in [(a.double(), b.double(), out.double()), (a.t().contiguous().t(), b, out),
                 (a, b, torch.full((5, 4), 7.0).t()), (a, b[:, :5], out),
                 (a, b, torch.empty(4, 4)), (a[:1].expand(4, 6), b, out)]:
        assert not cpu.gemm_nt(*args)
    assert (out == 7).all()


@kernel
def test_selection_finish_refuses_rows_short_of_k_and_sorts_whole_buffers():
    """finish: a row holding fewer than k keys is an error (nothing decoded); otherwise the
    k smallest of each row's buffer by (distance, index), stale slots past the count ignored
    (they are padded with the largest key before the sort)."""
    sel = cpu.knn_selection(3, 2, 5)
    sel.reset(3)
    sel.add(torch.tensor([[3.0, 1.0, 2.0]] * 3), 0)
    sel.count[1] = 1  # as if row 1 had seen one candidate
    with pytest.raises(RuntimeError, match="fewer than k"):
        sel.finish()
    sel.reset(3)
    sel.keys.fill_(0)  # stale keys (distance 0, index 0) that the counts leave out
    sel.add(torch.tensor([[3.0, 1.0, 2.0], [0.5, 0.5, 9.0], [7.0, 6.0, 5.0]]), 10)
    d, i = sel.finish()
    assert torch.equal(i, torch.tensor([[11, 12], [10, 11], [12, 11]]))
    assert torch.equal(d, torch.tensor([[1.0, 2.0], [0.5, 0.5], [5.0, 6.0]]))


@kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("library", [True, False])
def test_sort_rows_in_threads_is_numpy_sort(monkeypatch, threads, library):
    """The rows shared out to threads (down to one row each) sort as one numpy sort does, on
    the library's threads (numpy called back) and on Python threads without the library."""
    import numpy as np
    monkeypatch.setattr(cpu, "SORT_MIN_KEYS", 1)
    if not library:
        monkeypatch.setattr(cpu, "_lib", lambda: None)
    before = torch.get_num_threads()
    rng = np.random.default_rng(threads)
    a = rng.integers(0, 2**64 - 1, size=(7, 33), dtype=np.uint64)
    want = np.sort(a, axis=1)
    try:
        torch.set_num_threads(threads)
        cpu.sort_rows(a)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(a, want)


@kernel
def test_sort_rows_raises_what_a_share_raised(monkeypatch):
    """An exception inside a share (called back from C, where it cannot propagate) is raised
    by sort_rows, not printed and dropped: a read-only array cannot be sorted in place."""
    import numpy as np
    monkeypatch.setattr(cpu, "SORT_MIN_KEYS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    a = np.arange(20, 0, -1, dtype=np.uint64).reshape(4, 5)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cpu.sort_rows(a)


@kernel
def test_sort_rows_in_a_background_thread_beside_torch_work(monkeypatch):
    """The neighbour refresher searches in a background thread while training runs torch's ops
    on the main one: sort_rows' callbacks (which take the GIL on the library's threads) finish
    beside them, with numpy's result, and so do the main thread's ops."""
    import numpy as np
    monkeypatch.setattr(cpu, "SORT_MIN_KEYS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 2**63, size=(64, 500), dtype=np.uint64) for _ in range(20)]
    want = [np.sort(a, axis=1) for a in arrays]
    done = []

    def background():
        for a in arrays:
            cpu.sort_rows(a)
        done.append(True)

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    m = torch.randn(256, 256)
    deadline = time.monotonic() + 60  # a deadlock fails the test rather than hanging it
    while worker.is_alive() and time.monotonic() < deadline:
        m = torch.tanh(m @ m.t() / 256)  # torch's ops on the main thread meanwhile
    assert done == [True]
    assert all(np.array_equal(a, w) for a, w in zip(arrays, want))


@kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 5, 100])
def test_run_items_calls_back_every_item_once(threads, n):
    """nnk_run_items: fn(i) once for every i in [0, n), on up to ``threads`` threads; a null
    callback is refused."""
    lib = cpu._lib()
    seen = []
    rc = lib.nnk_run_items(n, threads, cpu._ITEM_CALLBACK(seen.append))
    assert rc == 0 and sorted(seen) == list(range(n))
    assert lib.nnk_run_items(3, threads, cpu._ITEM_CALLBACK()) == 2


@kernel
def test_selection_finish_is_the_same_on_several_threads(monkeypatch):
    """finish's pad and decode share out 64-row chunks (here 200 rows: four, the last short)
    and its sort the rows: the lists do not depend on the thread count, and are the
    (distance, index) order's k smallest."""
    g = torch.Generator().manual_seed(3)
    dist = torch.randint(0, 30, (200, 90), generator=g).float()  # many ties: index decides
    lists = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMS", 1)
        monkeypatch.setattr(cpu, "SORT_MIN_KEYS", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        lists.append(_selection_lists(cpu._lib(), dist, 7, 7 + 64, [40]))
    key = dist.double() * 1000 + torch.arange(90).double()  # (distance, index) order
    want_i = key.argsort(dim=1)[:, :7]
    for d, i in lists:
        assert torch.equal(i, want_i)
        assert torch.equal(d, dist.gather(1, want_i))


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
