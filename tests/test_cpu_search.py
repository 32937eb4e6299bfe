"""The exact search's compiled parts (nnkloss/cpu/search.py): the top-k selection, its sort and
decode, the GEMM of the distance tiles and the list overlap, against torch and fp64."""
import os
import tempfile
import threading
import time
import warnings

import pytest
import torch

from nnkloss import cpu
from nnkloss.cpu import build
from cases import in_fresh_process

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback tests below check the notice
    kernel = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: fallback only")

INDEX = [torch.int32, torch.int64]


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
    monkeypatch.setattr(build, "PARALLEL_MIN_ELEMS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert build.threads(2 * 64 * 64) == 2
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
@pytest.mark.skipif(os.uname().machine != "x86_64" or "avx2" not in build._cpu_flags().split(),
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
    native = build.lib()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        avx2 = cpu_variants.build("-march=x86-64-v3,!-march=native")
    finally:
        build._reset_for_tests()  # the next caller loads the native build again
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
    code = ("import torch\nfrom nnkloss import cpu\nsel = cpu.knn_selection(4, 3, 8)\n"
            "sel.reset(4)\ntry:\n    sel.add(torch.rand(5000, 40), 0)\n"
            "except ValueError as e:\n    print(e)\n")
    run = in_fresh_process(code, {})
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
    assert build.lib().nnk_knn_unkey(1, 4, 4, keys.data_ptr(), out_d.data_ptr(),
                                    out_i.data_ptr(), 0, 1) == 2
    assert build.lib().nnk_knn_unkey(1, 4, 4, keys.data_ptr(), out_d.data_ptr(),
                                    out_i.data_ptr(), -1, 1) == 0


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
    code = ("import torch\nfrom nnkloss import cpu\n"
            "new, old = torch.tensor([[0, 1]]), torch.tensor([[1, -1]])\n"
            "for m in (-1000, 2**62):\n    try:\n        cpu.list_overlap(new, old, m)\n"
            "    except (ValueError, MemoryError) as e:\n        print(type(e).__name__, e)\n")
    run = in_fresh_process(code, {})
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
    the library's threads (numpy called back), and without the library."""
    import numpy as np
    monkeypatch.setattr(cpu.search, "SORT_MIN_KEYS", 1)
    if not library:
        monkeypatch.setattr(build, "lib", lambda: None)
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
    monkeypatch.setattr(cpu.search, "SORT_MIN_KEYS", 1)
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
    monkeypatch.setattr(cpu.search, "SORT_MIN_KEYS", 1)
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
    lib = build.lib()
    seen = []
    rc = lib.nnk_run_items(n, threads, build.ITEM_CALLBACK(seen.append))
    assert rc == 0 and sorted(seen) == list(range(n))
    assert lib.nnk_run_items(3, threads, build.ITEM_CALLBACK()) == 2


@kernel
def test_selection_finish_is_the_same_on_several_threads(monkeypatch):
    """finish's pad and decode share out 64-row chunks (here 200 rows: four, the last short)
    and its sort the rows: the lists do not depend on the thread count, and are the
    (distance, index) order's k smallest."""
    g = torch.Generator().manual_seed(3)
    dist = torch.randint(0, 30, (200, 90), generator=g).float()  # many ties: index decides
    lists = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(build, "PARALLEL_MIN_ELEMS", 1)
        monkeypatch.setattr(cpu.search, "SORT_MIN_KEYS", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        lists.append(_selection_lists(build.lib(), dist, 7, 7 + 64, [40]))
    key = dist.double() * 1000 + torch.arange(90).double()  # (distance, index) order
    want_i = key.argsort(dim=1)[:, :7]
    for d, i in lists:
        assert torch.equal(i, want_i)
        assert torch.equal(d, dist.gather(1, want_i))
