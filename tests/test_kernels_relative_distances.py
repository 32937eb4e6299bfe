"""kernels/relative_distances.py: the classifier's relative squared distances as a Triton kernel,
against fp64 and against the CPU library's pass (Triton's interpreter on CPU tensors)."""
import pytest
import torch

import nnkloss
from cases import check_rel_sqdist, rel_sqdist_fp64

pytestmark = pytest.mark.interpreter

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _kernels():
    return nnkloss.ops.backends.kernels()


@pytest.mark.parametrize("bank_dtype", FLOATS)
@pytest.mark.parametrize("cdt", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [1, 13, 16, 300])
def test_matches_fp64(bank_dtype, cdt, D):
    # D 300 is two chunks of the tile's 256 columns, the second ragged; 11 entries of a list
    # at D 300 are two tiles of 8.
    check_rel_sqdist(_kernels().rel_sqdist, bank_dtype, cdt, D)


def test_far_queries_stay_precise():
    # |x| = 1e4: the two squared distances are ~1e8 (fp32 spacing 8), their difference ~1e1.
    # The naive difference of fp32 squares is off by ~8; the product form by ~1e-4 here.
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(30, 6, generator=g)
    x = torch.randn(5, 6, generator=g) * 1e4
    idx = torch.randint(0, 30, (5, 8), generator=g)
    ref = idx[:, 0]
    got = _kernels().rel_sqdist(x, centres, idx, ref, torch.float32).double()
    want = rel_sqdist_fp64(x, centres, idx, ref)
    tol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    naive = (((centres[idx] - x[:, None]) ** 2).sum(-1)
             - ((centres[ref] - x) ** 2).sum(-1)[:, None]).double()
    assert (naive - want).abs().max() > 10 * tol  # the case does tell the two forms apart


def test_strided_inputs_int32_lists_and_long_lists():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(50, 40, generator=g)
    centres = wide[:, 3:27]                        # row stride 40, base offset 3 elements
    x = torch.randn(7, 30, generator=g)[:, 2:26]   # row stride 30, base offset 2 elements
    idx = torch.randint(0, 50, (7, 1000), generator=g, dtype=torch.int32)  # two tiles of 512
    ref = torch.randint(0, 50, (7,), generator=g, dtype=torch.int32)
    got = _kernels().rel_sqdist(x, centres, idx, ref, torch.float64)
    want = rel_sqdist_fp64(x, centres, idx, ref)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    # column strides other than 1 (copied by the launcher): the queries, the lists
    xs = torch.zeros(7, 48, dtype=x.dtype)
    xs[:, ::2] = x
    cols = _kernels().rel_sqdist(xs[:, ::2], centres, idx[:, ::3], ref, torch.float64)
    torch.testing.assert_close(cols, want[:, ::3], rtol=0, atol=1e-11)


def test_agrees_with_the_cpu_library():
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(200, 64, generator=g)
    x = torch.randn(12, 64, generator=g) * 3
    idx = torch.randint(0, 200, (12, 37), generator=g)
    a = _kernels().rel_sqdist(x, centres, idx, idx[:, 0], torch.float32)
    b = cpu.rel_sqdist(x, centres, idx, idx[:, 0], torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_empty_shapes_and_a_bad_compute_dtype():
    k = _kernels()
    centres = torch.randn(10, 4)
    x = torch.randn(3, 4)
    assert k.rel_sqdist(x, centres, torch.zeros(3, 0, dtype=torch.long),
                        torch.zeros(3, dtype=torch.long), torch.float32).shape == (3, 0)
    assert k.rel_sqdist(x[:0], centres, torch.zeros(0, 2, dtype=torch.long),
                        torch.zeros(0, dtype=torch.long), torch.float64).shape == (0, 2)
    with pytest.raises(ValueError, match="cdt"):
        k.rel_sqdist(x, centres, torch.zeros(3, 2, dtype=torch.long),
                     torch.zeros(3, dtype=torch.long), torch.float16)


@pytest.mark.parametrize("K,D", [(1, 1), (7, 64), (100, 16), (1000, 64), (3, 1000)])
def test_config_tiles_hold_at_most_the_tile(K, D):
    from nnkloss.kernels.relative_distances import REL_SQDIST_TILE, rel_sqdist_config
    bk, bd = rel_sqdist_config(K, D)
    assert bk & (bk - 1) == 0 and bd & (bd - 1) == 0
    assert bk * bd <= max(REL_SQDIST_TILE, bd) and bd <= 256
    assert bk <= max(1, 1 << (K - 1).bit_length())


class _RecordingKernel:
    """Stands in for _rel_sqdist_kernel: records each launch's grid and part of the result
    (K, the lists' first entry) instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(x, centres, idx, ref, out, K, D, *strides, **meta):
            self.launches.append((grid, x.shape[0], K, int(idx[0, 0]) if idx.numel() else None,
                                  out.data_ptr(), meta["BLOCK_K"]))
        return launch


@pytest.mark.parametrize("K,D", [(524_281, 256), (524_281, 300), (2_000_000, 64),
                                 (524_280, 256), (10, 256)])
def test_grids_stay_within_cuda_limits(monkeypatch, K, D):
    """The grid was (Q, cdiv(K, block_k)): at D >= 256 (tiles of 8 entries) a list longer than
    524,280 entries asked for more than CUDA's 65535 programs along axis 1, and the launch
    failed. Longer lists are now split into launches each within the limits (x: 2**31 - 1,
    y / z: 65535) that together cover every entry once, with one block size."""
    from nnkloss.kernels import relative_distances as rd
    rec = _RecordingKernel()
    monkeypatch.setattr(rd, "_rel_sqdist_kernel", rec)
    Q = 2
    x, centres = torch.zeros(Q, D), torch.zeros(3, D)
    idx = torch.arange(K).repeat(Q, 1)  # entry j of a list is j: where each part starts
    out = rd.rel_sqdist(x, centres, idx, idx[:, 0], torch.float32)
    assert out.shape == (Q, K)
    bk = rd.rel_sqdist_config(K, D)[0]
    covered = 0
    for grid, rows, k, first, ptr, block_k in rec.launches:
        assert grid[0] == rows <= 2**31 - 1 and 1 <= grid[1] <= 65535 and len(grid) == 2
        assert grid[1] == -(-k // bk) and block_k == bk
        assert ptr == out[0, first].data_ptr()  # the part's output columns start at its lists'
        covered += k
    assert covered == K
    assert len(rec.launches) == -(-K // (65535 * bk))
    plan = rd.rel_sqdist_launches(Q, K, D)
    assert [(k1 - k0, g) for _, _, k0, k1, g in plan] == [(k, g) for g, _, k, *_ in rec.launches]


def test_query_rows_past_the_x_limit_are_split():
    """Axis 0 (the query rows) holds 2**31 - 1 programs: more rows than that (not reachable
    in memory today, checked on the host) are split too."""
    from nnkloss.kernels import relative_distances as rd
    plan = rd.rel_sqdist_launches(2**31 + 5, 3, 16)
    assert [(q0, q1, k0, k1) for q0, q1, k0, k1, _ in plan] == [
        (0, 2**31 - 1, 0, 3), (2**31 - 1, 2**31 + 5, 0, 3)]
    assert all(g[0] <= 2**31 - 1 and g[1] <= 65535 for *_, g in plan)
    assert rd.rel_sqdist_launches(0, 5, 4) == [] and rd.rel_sqdist_launches(4, 0, 4) == []


def test_split_launches_compute_the_same_result(monkeypatch):
    """The interpreter runs the parts: limits lowered so that a small result takes several
    launches along both axes (rows and list tiles), each on its slices of x, ref, the lists
    and the output; the result equals fp64 as one launch does."""
    from nnkloss.kernels import relative_distances as rd
    g = torch.Generator().manual_seed(8)
    centres = torch.randn(40, 300, generator=g)
    x = torch.randn(5, 300, generator=g)
    idx = torch.randint(0, 40, (5, 37), generator=g)
    ref = torch.randint(0, 40, (5,), generator=g)
    whole = rd.rel_sqdist(x, centres, idx, ref, torch.float64)
    monkeypatch.setattr(rd, "MAX_GRID_X", 2)
    monkeypatch.setattr(rd, "MAX_GRID_Y", 2)
    plan = rd.rel_sqdist_launches(5, 37, 300)
    assert len(plan) == 3 * 3  # rows 2 + 2 + 1, entries 16 + 16 + 5 (tiles of 8)
    split = rd.rel_sqdist(x, centres, idx, ref, torch.float64)
    torch.testing.assert_close(split, rel_sqdist_fp64(x, centres, idx, ref), rtol=0, atol=1e-10)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
