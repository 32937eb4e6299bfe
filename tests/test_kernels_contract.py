"""The Triton launchers against the forward contract (nnkloss/ops/CONTRACT.md), fp64 reference.

Interpreter runs on CPU tensors and tiny shapes: scaled distances, loss, logsumexps and grad_x;
int32/int64 lists and labels (of different dtypes); store_dist on/off; several K tiles, the
two-phase (wide D) path and several rows per program; the non-finite rule (NaN/inf in an
embedding, a gathered centre or a weight; fp32 overflow); an empty bank. The reference is the
tests' fp64 one (tests/reference.py ``forward``).
"""
import math

import pytest
import torch

from reference import forward as contract_forward

pytestmark = pytest.mark.interpreter


def _kernels():
    from nnkloss.ops.backends import kernels as load
    return load()


def make(B=6, N=30, D=12, K=9, seed=0, pad=0.25, zero_w=0.15, idx_dtype=torch.int64,
         lab_dtype=torch.int64, clab_dtype=torch.int32, emb_dtype=torch.float32,
         bank_dtype=torch.float32, n_classes=3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g).to(bank_dtype)
    cl = torch.randint(0, n_classes, (N,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g)
    nb[torch.rand(B, K, generator=g) < pad] = -1
    labels = torch.randint(0, n_classes, (B,), generator=g)
    labels[-1] = n_classes + 5  # a row with no positive
    emb = (0.7 * torch.randn(B, D, generator=g)).to(emb_dtype)
    w = torch.rand(N, generator=g) + 0.5
    w[torch.rand(N, generator=g) < zero_w] = 0.0
    return (emb, labels.to(lab_dtype), centres, cl.to(clab_dtype), nb.to(idx_dtype), w,
            torch.tensor(1.3))


def check(got, ref, store_dist=True, tol=2e-5):
    names = ["loss", "lse_all", "lse_pos", "grad_x", "dist"]
    for name, a, r in zip(names, got, ref):
        if name == "dist" and not store_dist:
            assert a.shape == (r.shape[0], 0), name
            continue
        torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol, equal_nan=True, msg=name)


@pytest.mark.parametrize("idx_dtype, lab_dtype, clab_dtype", [
    (torch.int32, torch.int32, torch.int64), (torch.int64, torch.int64, torch.int32),
    (torch.int32, torch.int64, torch.int64)])
@pytest.mark.parametrize("store_dist", [True, False])
def test_matches_contract_int_dtypes(idx_dtype, lab_dtype, clab_dtype, store_dist):
    args = make(idx_dtype=idx_dtype, lab_dtype=lab_dtype, clab_dtype=clab_dtype, seed=1)
    got = _kernels().neighbour_kernel_fwd(*args, store_dist=store_dist)
    check(got, contract_forward(*args), store_dist)


@pytest.mark.parametrize("cfg", [dict(block_k=2, block_d=16), dict(block_k=4, block_d=4),
                                 dict(block_k=2, block_d=16, rows=4),
                                 dict(block_k=8, block_d=8, rows=2)])
@pytest.mark.parametrize("store_dist", [True, False])
def test_tiles_two_phase_and_rows(cfg, store_dist):
    """Several K tiles (block_k 2), two-phase path (block_d < D) with and without a stored
    dist (scratch), several rows per program with B not a multiple of rows."""
    k = _kernels()
    args = make(B=7, D=12, K=9, seed=2, idx_dtype=torch.int32)
    got = k.neighbour_kernel_fwd(*args, config=k.FwdConfig(num_warps=1, **cfg),
                                 store_dist=store_dist)
    check(got, contract_forward(*args), store_dist)


@pytest.mark.parametrize("cfg", [dict(block_k=2, block_d=16), dict(block_k=4, block_d=4),
                                 dict(block_k=2, block_d=16, rows=4),
                                 dict(block_k=16, block_d=16)])
@pytest.mark.parametrize("need_grad_x", [True, False])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_prefetched_list_entries_give_the_same_bits(cfg, need_grad_x, idx_dtype):
    """FwdConfig.prefetch_index (the next tile's entries loaded during this tile) changes only
    the order of the loads: every output bit for bit as without it, and the contract's, over
    several K tiles and a last partial one (K 9), the two-phase path, several rows per program
    (B 7, not a multiple of 4), one tile holding the whole list, padding, zero weights, an
    entry past the bank and a non-finite centre."""
    k = _kernels()
    emb, labels, centres, cl, nb, w, s = make(B=7, D=12, K=9, seed=6, idx_dtype=idx_dtype)
    j = int(nb[4][nb[4] >= 0][-1])
    centres[j, 1] = math.inf  # gathered by row 4 in its last tile
    past = nb.clone()
    past[2, 5] = centres.shape[0] + 3  # an entry past the bank: row 2 NaN (CONTRACT.md 9)

    def both(lists):
        args = (emb, labels, centres, cl, lists, w, s)
        return [k.neighbour_kernel_fwd(*args, config=k.FwdConfig(num_warps=1, prefetch_index=p,
                                                                 **cfg),
                                       store_dist=True, need_grad_x=need_grad_x)
                for p in (False, True)]

    for lists in (nb, past):
        plain, pre = both(lists)
        for a, b in zip(plain, pre):
            assert a.shape == b.shape
            assert torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30))
        assert plain[0][4].isnan() and plain[0][2].isnan() == (lists is past)
        assert plain[0][~plain[0].isnan()].gt(0).any()  # rows that carry a loss
    ref = contract_forward(emb, labels, centres, cl, nb, w, s)  # it indexes: no past entry
    if not need_grad_x:
        ref = ref[:3] + (ref[3][:, :0],) + ref[4:]
    check(both(nb)[1], ref)


def test_max_block_d_two_phase_and_low_precision_bank():
    args = make(B=4, D=20, K=6, seed=3, bank_dtype=torch.bfloat16, emb_dtype=torch.bfloat16)
    got = _kernels().neighbour_kernel_fwd(*args, max_block_d=8, store_dist=False)
    check(got, contract_forward(*args), store_dist=False)


def test_fp64_is_tight():
    args = make(B=4, D=7, K=5, seed=4, emb_dtype=torch.float64, bank_dtype=torch.float64)
    got = _kernels().neighbour_kernel_fwd(*args, config=_kernels().FwdConfig(2, 8, 1))
    assert got[0].dtype == torch.float64
    check(got, contract_forward(*args), tol=1e-12)


@pytest.mark.parametrize("bad_value", [math.nan, math.inf])
@pytest.mark.parametrize("two_phase", [False, True])
def test_non_finite_embedding_and_centre(bad_value, two_phase):
    """A NaN/inf in one embedding makes only that row NaN; one in a gathered centre makes the
    rows that gather it NaN (never loss 0 / "no positive"); other rows are untouched."""
    k = _kernels()
    emb, labels, centres, cl, nb, w, s = make(B=6, N=30, D=10, K=8, seed=5, pad=0.1)
    emb[1, 3] = bad_value
    j = int(nb[4][nb[4] >= 0][0])
    centres[j, 2] = bad_value
    args = (emb, labels, centres, cl, nb, w, s)
    cfg = k.FwdConfig(2, 4, 1) if two_phase else None
    got = k.neighbour_kernel_fwd(*args, config=cfg)
    ref = contract_forward(*args)
    rows_with_j = (nb == j).any(1)
    for r in range(6):
        expect_nan = r == 1 or bool(rows_with_j[r])
        for t in got[:4]:
            assert bool(torch.isnan(t[r]).all()) == expect_nan, (r, t[r])
    check(got, ref)


@pytest.mark.parametrize("w_bad", [math.nan, -1.0, math.inf])
def test_non_finite_weight(w_bad):
    emb, labels, centres, cl, nb, w, s = make(seed=6, pad=0.0, zero_w=0.0)
    w[int(nb[2, 0])] = w_bad
    got = _kernels().neighbour_kernel_fwd(emb, labels, centres, cl, nb, w, s)
    assert torch.isnan(got[0][2]) and torch.isnan(got[3][2]).all()
    check(got, contract_forward(emb, labels, centres, cl, nb, w, s))


def test_overflow_scaled_before_squaring():
    """|x| ~ 1e20: sigma 1 overflows u (row NaN); sigma 1e10 stays finite and matches."""
    k = _kernels()
    emb, labels, centres, cl, nb, w, _ = make(B=3, D=6, K=5, seed=7, pad=0.0, zero_w=0.0)
    emb = emb * 1e20
    for sigma, finite in ((1.0, False), (1e10, True)):
        s = torch.tensor(sigma)
        got = k.neighbour_kernel_fwd(emb, labels, centres, cl, nb, w, s)
        ref = contract_forward(emb, labels, centres, cl, nb, w, s)
        assert bool(torch.isfinite(got[0]).all()) == finite
        if not finite:
            assert torch.isnan(got[0]).all() and torch.isinf(got[4]).all()
            continue
        torch.testing.assert_close(got[4].double(), ref[4], rtol=1e-5, atol=0)
        for i in (1, 2):
            fin = torch.isfinite(ref[i])
            assert torch.equal(torch.isfinite(got[i]), fin)
            torch.testing.assert_close(got[i][fin].double(), ref[i][fin], rtol=1e-5, atol=0)
        scale = ref[1].abs().clamp_min(1) * 1e-5
        assert ((got[0].double() - ref[0]).abs() <= scale).all()
        assert torch.isfinite(got[3]).all()


def test_empty_bank_and_all_padding():
    k = _kernels()
    emb = torch.randn(3, 5)
    out = k.neighbour_kernel_fwd(emb, torch.zeros(3, dtype=torch.int32),
                                 torch.empty(0, 5), torch.empty(0, dtype=torch.int64),
                                 torch.full((3, 4), -1, dtype=torch.int32), None,
                                 torch.tensor(1.0))
    assert (out[0] == 0).all() and (out[2] == -math.inf).all() and (out[3] == 0).all()
    assert (out[4] == 0).all() and out[4].shape == (3, 4)
    # An entry of an empty bank (the checks off) is past it: its row is NaN (rule 9), not
    # "no positive", as on the CPU; the other rows as before.
    nb = torch.full((3, 4), -1, dtype=torch.int32)
    nb[1, 2] = 0
    out = k.neighbour_kernel_fwd(emb, torch.zeros(3, dtype=torch.int32), torch.empty(0, 5),
                                 torch.empty(0, dtype=torch.int64), nb, torch.empty(0),
                                 torch.tensor(1.0))
    for t in out[:4]:
        assert torch.isnan(t[1]).all() and not torch.isnan(t[[0, 2]]).any()
    assert torch.isnan(out[4][1, 2]) and (out[4][nb < 0] == 0).all()
    assert (out[0][[0, 2]] == 0).all() and (out[2][[0, 2]] == -math.inf).all()
    # A non-empty bank with an all-padding row: same outputs, even for a NaN embedding.
    args = list(make(B=3, seed=8))
    args[0][1] = math.nan
    args[4][1] = -1
    got = k.neighbour_kernel_fwd(*args)
    assert got[0][1] == 0 and got[2][1] == -math.inf and (got[3][1] == 0).all()
    check(got, contract_forward(*args))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize("grad_x", [True, False])
@pytest.mark.parametrize("weights", [True, False])
def test_entries_past_the_bank_read_nothing_and_make_their_row_nan(idx_dtype, two_phase, grad_x,
                                                                   weights):
    """Rule 9: a list entry >= N (the value checks off let it through) reads nothing, its
    distance is NaN and its row non-finite, as on the CPU; every other row and entry as if it
    were padding. The centre gradient skips it. An entry of 2**31 - 1 would read 2**31 rows
    past the bank: gigabytes outside any tensor."""
    k = _kernels()
    emb, labels, centres, cl, nb, w, s = make(B=6, N=30, D=10, K=8, seed=11, pad=0.1,
                                              idx_dtype=idx_dtype)
    far = 2**31 - 1
    nb[2, 1], nb[4, 0] = 30, far
    w = w if weights else None
    cfg = k.FwdConfig(2, 4, 1) if two_phase else None
    got = k.neighbour_kernel_fwd(emb, labels, centres, cl, nb, w, s, config=cfg,
                                 need_grad_x=grad_x)
    padded = nb.masked_fill(nb >= 30, -1)
    ref = contract_forward(emb, labels, centres, cl, padded, w, s)
    poisoned = torch.tensor([False, False, True, False, True, False])
    for t in got[:4 if grad_x else 3]:
        assert torch.isnan(t[poisoned]).all() and not torch.isnan(t[~poisoned]).any()
    assert torch.isnan(got[4][2, 1]) and torch.isnan(got[4][4, 0])
    keep = ~poisoned
    ref = [r[keep] for r in ref]
    if not grad_x:
        ref[3] = ref[3][:, :0]
    check([t[keep] for t in got], ref)
    inbank = (nb >= 0) & (nb < 30)
    torch.testing.assert_close(got[4][inbank].double(),
                               contract_forward(emb, labels, centres, cl, padded, w, s)[4][inbank],
                               rtol=2e-5, atol=2e-5)
    from nnkloss import cpu
    if cpu.available():  # the same outputs as the CPU library's, NaNs included
        want = cpu.forward(emb, labels, centres, cl, nb, w, s, need_grad_x=grad_x)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, equal_nan=True)
    coef = torch.randn(6, 8)
    grad = k.centre_grad(emb, centres, nb, coef)
    torch.testing.assert_close(grad, k.centre_grad(emb, centres, padded, coef))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_centre_grad(idx_dtype):
    emb, labels, centres, cl, nb, w, s = make(B=5, N=12, D=9, K=6, seed=9)
    nb = nb.to(idx_dtype)
    coef = torch.randn(5, 6)
    coef[0, 0] = 0.0
    got = _kernels().centre_grad(emb, centres, nb, coef)
    ref = torch.zeros(12, 9, dtype=torch.float64)
    for b in range(5):
        for kk in range(6):
            j = int(nb[b, kk])
            if j >= 0:
                ref[j] += float(coef[b, kk]) * (emb[b].double() - centres[j].double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_centre_grad_of_views_with_another_column_stride():
    # CCML's backward hands the caller's emb and centres to centre_grad as they are: transposed
    # views were read at unit column stride (another row's values: gradients off by ~2.5).
    emb, labels, centres, cl, nb, w, s = make(B=5, N=12, D=9, K=6, seed=10)
    coef = torch.randn(5, 6)
    k = _kernels()
    want = k.centre_grad(emb, centres, nb, coef)
    got = k.centre_grad(emb.t().contiguous().t(), centres.t().contiguous().t(),
                        nb.t().contiguous().t(), coef)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_row_align():
    k = _kernels()
    assert k.neighbour_kernel.row_align(1000, torch.empty(3, 1000)) == 4
    assert k.neighbour_kernel.row_align(300, torch.empty(3, 300, dtype=torch.bfloat16)) == 4
    assert k.neighbour_kernel.row_align(1000, torch.empty(3, 1000, dtype=torch.bfloat16)) == 8
    assert k.neighbour_kernel.row_align(7, torch.empty(3, 7)) == 1
    assert k.neighbour_kernel.row_align(8, torch.empty(3, 9)[:, 1:]) == 1  # odd base address


@pytest.mark.parametrize("cfg", [None, dict(block_k=2, block_d=16), dict(block_k=4, block_d=4),
                                 dict(block_k=8, block_d=8, rows=2)])
@pytest.mark.parametrize("store_dist", [True, False])
def test_forward_only_build(cfg, store_dist):
    """need_grad_x=False (the GRAD_X=False build): grad_x is (B, 0) and loss, lse's and dist
    are bit for bit the full forward's, on the single-pass and the two-phase path (which then
    needs no second phase and no dist scratch); non-finite rows stay NaN."""
    k = _kernels()
    emb, labels, centres, cl, nb, w, s = make(B=7, D=12, K=9, seed=10, idx_dtype=torch.int32)
    emb[2, 5] = math.nan
    args = (emb, labels, centres, cl, nb, w, s)
    config = None if cfg is None else k.FwdConfig(num_warps=1, **cfg)
    full = k.neighbour_kernel_fwd(*args, config=config, store_dist=store_dist)
    fwd = k.neighbour_kernel_fwd(*args, config=config, store_dist=store_dist, need_grad_x=False)
    assert fwd[3].shape == (7, 0) and fwd[3].dtype == torch.float32
    for i in (0, 1, 2, 4):
        assert torch.equal(full[i].nan_to_num(7.0), fwd[i].nan_to_num(7.0)), i
    assert torch.isnan(fwd[0][2])
    ref = contract_forward(*args)
    check(fwd[:3] + (ref[3].float(),) + fwd[4:], ref, store_dist)


@pytest.mark.parametrize("B, cfg, need_grad_x", [
    (7, dict(block_k=2, block_d=16), g) for g in (True, False)] + [
    (7, dict(block_k=2, block_d=16, rows=4), g) for g in (True, False)] + [
    (7, dict(block_k=4, block_d=4), g) for g in (True, False)] + [
    (None, dict(block_k=16, block_d=16), False)])
def test_the_mean_on_every_path(B, cfg, need_grad_x):
    """mean=True (the MEAN build): the five outputs bit for bit the plain launch's, counted
    as the reference counts, the mean over them and its divisor; single pass and two-phase,
    training and forward-only, several rows a program (B not a multiple), and more programs
    than the last one reads in one step (B None: MEAN_BLOCK + 45 rows)."""
    from nnkloss.ops import reference
    k = _kernels()
    B = B or k.neighbour_kernel.MEAN_BLOCK.value + 45
    emb, labels, centres, cl, nb, w, s = make(B=B, D=12, K=9, seed=12, idx_dtype=torch.int32)
    # The row without a positive first: the last row, which a program's rows past B repeat,
    # is counted (counted twice, it would show).
    args = (emb.roll(1, 0), labels.roll(1, 0), centres, cl, nb.roll(1, 0), w, s)
    config = k.FwdConfig(num_warps=1, **cfg)
    plain = k.neighbour_kernel_fwd(*args, config=config, need_grad_x=need_grad_x)
    out = k.neighbour_kernel_fwd(*args, config=config, need_grad_x=need_grad_x, mean=True)
    for a, b in zip(plain, out[:5]):
        assert torch.equal(a, b)
    counted = reference.counted_rows(plain[2])
    assert torch.equal(out[5], counted) and 0 < int(counted.sum()) < B and counted[-1]
    assert float(out[7]) == int(counted.sum())
    torch.testing.assert_close(out[6].double(), plain[0].double().sum() / counted.sum(),
                               rtol=1e-6, atol=0)
