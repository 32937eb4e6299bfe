"""nnkloss.bank.search (nnkloss.knn): both search backends against brute force, tie order,
self-exclusion, the threshold selection, the compiled CPU selection and its torch fallback,
edge cases, errors, recall."""
import dataclasses
import importlib
import math
import types
import warnings

import pytest
import torch

import nnkloss
import nnkloss.bank.search as K
import nnkloss.bank.search.faiss_search as FS
import nnkloss.bank.search.torch_search as TS
from nnkloss.bank.search import drop_self, iter_knn, knn, recall_against_exact
from nnkloss import cpu

HAVE_FAISS = K.faiss_available()
BACKENDS = ["torch", pytest.param("faiss", marks=pytest.mark.skipif(not HAVE_FAISS,
                                                                        reason="faiss missing"))]


def brute(queries, base, k, exclude_self=False):
    """Reference k smallest squared distances, one query row at a time (fp64, no Q x N matrix)."""
    q64, b64 = queries.double(), base.double()
    out = []
    for i in range(q64.shape[0]):
        d = (b64 - q64[i]).pow(2).sum(1)
        if exclude_self:
            d[i] = math.inf
        out.append(d.sort().values[:k])
    return torch.stack(out) if out else torch.empty(0, k, dtype=torch.float64)


def check_result(queries, base, k, dist, idx, exclude_self=False, rtol=1e-4, atol=1e-4):
    q = queries.shape[0]
    assert dist.shape == (q, k) and idx.shape == (q, k)
    assert dist.dtype == torch.float32 and idx.dtype == torch.int64
    if q == 0:
        return
    ref = brute(queries, base, k, exclude_self)
    # Distances, not indices, are compared so that ties may resolve either way ...
    torch.testing.assert_close(dist.double(), ref, rtol=rtol, atol=atol)
    assert (dist[:, 1:] >= dist[:, :-1]).all(), "distances must ascend"
    # ... and the indices must be distinct, in range and give exactly those distances.
    assert ((idx >= 0) & (idx < base.shape[0])).all()
    s = idx.sort(1).values
    assert (s[:, 1:] != s[:, :-1]).all(), "a row repeats an index"
    true_d = (base.double()[idx] - queries.double()[:, None, :]).pow(2).sum(-1)
    torch.testing.assert_close(dist.double(), true_d, rtol=rtol, atol=atol)
    if exclude_self:
        assert (idx != torch.arange(q)[:, None]).all(), "a row returned itself"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exclude_self", [False, True])
def test_matches_brute_force(backend, exclude_self):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 24, generator=g)
    queries = base if exclude_self else torch.randn(77, 24, generator=g)
    k = 10
    # A tiny tile budget forces many query and base tiles: exercises the running merge.
    dist, idx = knn(queries, base, k, search_backend=backend, exclude_self=exclude_self,
                    tile_bytes=40_000)
    check_result(queries, base, k, dist, idx, exclude_self)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_tiles_and_auto(backend):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(257, 8, generator=g)
    queries = torch.randn(31, 8, generator=g)
    for b in (backend, "auto"):
        dist, idx = knn(queries, base, 7, search_backend=b)
        check_result(queries, base, 7, dist, idx)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exclude_self,k", [(False, 1), (True, 1), (True, 49), (False, 50)])
def test_extreme_k(backend, exclude_self, k):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(50, 5, generator=g)
    queries = base if exclude_self else torch.randn(9, 5, generator=g)
    dist, idx = knn(queries, base, k, search_backend=backend, exclude_self=exclude_self,
                    tile_bytes=3000)
    check_result(queries, base, k, dist, idx, exclude_self)
    if k == base.shape[0] - int(exclude_self):  # every candidate is returned exactly once
        all_rows = torch.arange(base.shape[0]).expand(queries.shape[0], -1)
        if exclude_self:
            all_rows = all_rows[all_rows != torch.arange(50)[:, None]].view(50, 49)
        assert torch.equal(idx.sort(1).values, all_rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_query(backend):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(100, 12, generator=g)
    queries = torch.randn(1, 12, generator=g)
    dist, idx = knn(queries, base, 5, search_backend=backend, tile_bytes=2000)
    check_result(queries, base, 5, dist, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_points(backend):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(40, 6, generator=g).repeat(3, 1)  # every point three times
    dist, idx = knn(base, base, 4, search_backend=backend, exclude_self=True, tile_bytes=2000)
    check_result(base, base, 4, dist, idx, exclude_self=True)
    # The two twins come first, at distance 0, and they are not the row itself.
    assert (dist[:, :2] <= 1e-4).all()
    n0 = 40
    assert ((idx[:, :2] % n0) == (torch.arange(120) % n0)[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_inputs_give_fp32_distances(dtype):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(90, 16, generator=g).to(dtype)
    queries = torch.randn(13, 16, generator=g).to(dtype)
    dist, idx = knn(queries, base, 6, search_backend="torch", tile_bytes=5000)
    # Exact on the (rounded) input values: they are upcast before any arithmetic.
    check_result(queries.float(), base.float(), 6, dist, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_queries(backend):
    base = torch.randn(10, 3)
    dist, idx = knn(torch.empty(0, 3), base, 4, search_backend=backend)
    assert dist.shape == (0, 4) and idx.shape == (0, 4)
    assert dist.dtype == torch.float32 and idx.dtype == torch.int64


def test_tile_sizes_respect_budget():
    for q, n, d, k, budget in [(10**6, 10**6, 128, 100, 256 * 2**20),
                               (10**5, 10**6, 2048, 100, 256 * 2**20),
                               (500, 300, 24, 10, 40_000)]:
        tq, tb = TS.tile_sizes(q, n, d, k, budget)
        assert 1 <= tq <= q and 1 <= tb <= n
        if tq > 1:  # a one-row tile is the floor; otherwise the working set fits
            assert tq * tb * 12 + tq * d * 4 + tb * d * 4 <= budget
        assert tq * tb < q * n  # never the whole Q x N matrix for these shapes


# ----------------------------------------------------------------------------- errors
def test_k_too_large_names_k():
    base = torch.randn(10, 3)
    with pytest.raises(ValueError, match=r"k=11"):
        knn(torch.randn(2, 3), base, 11, search_backend="torch")
    with pytest.raises(ValueError, match=r"k=10.*exclude_self"):
        knn(base, base, 10, search_backend="torch", exclude_self=True)
    with pytest.raises(ValueError, match=r"k must be >= 1"):
        knn(base, base, 0, search_backend="torch")
    with pytest.raises(TypeError, match=r"k must be an int"):
        knn(base, base, True, search_backend="torch")
    with pytest.raises(ValueError, match=r"k=3"):  # checked even when there are no queries
        knn(torch.empty(0, 3), base[:2], 3, search_backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(backend):
    base = torch.randn(10, 3)
    with pytest.raises(ValueError, match="base is empty"):
        knn(torch.randn(2, 3), torch.empty(0, 3), 1, search_backend=backend)
    bad = base.clone()
    bad[4, 1] = float("nan")
    with pytest.raises(ValueError, match=r"queries contains NaN or inf \(first bad row: 4\)"):
        knn(bad, base, 2, search_backend=backend)
    bad[4, 1] = float("inf")
    with pytest.raises(ValueError, match=r"base contains NaN or inf \(first bad row: 4\)"):
        knn(torch.randn(2, 3), bad, 2, search_backend=backend)
    with pytest.raises(ValueError, match="dimension"):
        knn(torch.randn(2, 4), base, 2, search_backend=backend)
    with pytest.raises(ValueError, match=r"at least one column \(D >= 1\)"):
        knn(torch.randn(2, 0), torch.randn(10, 0), 2, search_backend=backend)
    with pytest.raises(ValueError, match="exclude_self"):
        knn(torch.randn(2, 3), base, 1, search_backend=backend, exclude_self=True)
    with pytest.raises(TypeError, match="queries"):
        knn(torch.randint(0, 3, (2, 3)), base, 1, search_backend=backend)
    with pytest.raises(ValueError, match="queries must be 2-D"):
        knn(torch.randn(3), base, 1, search_backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_whose_distances_overflow_fp32_are_refused(backend):
    # Finite rows whose fp32 distances ||q||^2 - 2 q.b + ||b||^2 overflow (inf, or NaN as
    # inf - inf) were ranked wrong without a sign: fp64 1e300 is inf once cast to fp32, fp32
    # 1e20 squares to inf. Refused, naming the argument and the row.
    base = torch.randn(6, 3)
    big = base.clone()
    big[2, 0] = 1e20
    with pytest.raises(ValueError, match=r"queries has a row of norm 1e\+20 \(first such row: 2\)"):
        knn(big, base, 2, search_backend=backend)
    with pytest.raises(ValueError, match=r"base has a row of norm 1e\+20 \(first such row: 2\)"):
        knn(base, big, 2, search_backend=backend)
    huge = base.double()
    huge[4, 1] = 1e300
    with pytest.raises(ValueError, match=r"queries has a row of norm 1e\+300 \(first such row: 4\)"):
        knn(huge, huge, 1, search_backend=backend, exclude_self=True)
    # a large value in a row of small norm still passes where sqrt(D) max |value| would not
    ok = torch.zeros(6, 64)
    ok[:, 0] = torch.arange(6) * 2.0 ** 59  # norms up to 5 * 2**59 <= 2**62 < 8 * 5 * 2**59
    dist, idx = knn(ok, ok, 1, search_backend=backend, exclude_self=True)
    assert idx[:, 0].tolist() == [1, 0, 1, 2, 3, 4]


def test_bad_tile_bytes_are_named():
    # 0 or a negative budget ran silently as one byte (one query row by one base row per tile:
    # about 100x slower at N = 300); a string failed in int() without naming the argument
    base = torch.randn(10, 3)
    for bad in (0, -5, 0.5, "1GiB", True):
        with pytest.raises(ValueError, match=r"^tile_bytes must be a positive number of bytes"):
            knn(base, base, 2, search_backend="torch", tile_bytes=bad)
    from nnkloss.evaluation import metrics
    with pytest.raises(ValueError, match=r"^tile_bytes must be a positive number of bytes"):
        metrics.evaluate(base, torch.arange(10) % 2, (1,), tile_bytes=0)
    # the smallest budget, and a float one, still run
    ref = knn(base, base, 2, search_backend="torch")
    for ok in (1, 2000, 2e6):
        got = knn(base, base, 2, search_backend="torch", tile_bytes=ok)
        assert torch.equal(got.neighbours, ref.neighbours)


def test_bad_options():
    base = torch.randn(10, 3)
    with pytest.raises(ValueError, match="backend"):
        knn(base, base, 1, search_backend="annoy")
    with pytest.raises(ValueError, match="approximate"):
        knn(base, base, 1, approximate="lsh")
    with pytest.raises(ValueError, match="search_backend must be 'auto' or 'faiss'"):
        knn(base, base, 1, search_backend="torch", approximate="ivf")


def test_missing_faiss(monkeypatch):
    monkeypatch.setattr(FS, "_faiss_module", lambda: None)
    base = torch.randn(10, 3)
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        knn(base, base, 2, search_backend="faiss")
    with pytest.raises(ImportError, match="faiss"):
        knn(base, base, 2, approximate="hnsw")
    # "auto" quietly uses the torch backend.
    dist, idx = knn(base, base, 2, search_backend="auto")
    check_result(base, base, 2, dist, idx)


def test_missing_faiss_is_reported_by_the_call_naming_the_argument(monkeypatch):
    """Without faiss, search_backend="faiss" or an approximate index is refused where it is
    asked for: iter_knn returned a generator that failed only at its first next(), the
    classifier's constructor and evaluate accepted "faiss" and failed only at their search,
    and knn checked (a pass over) the inputs before saying that faiss was missing."""
    from nnkloss.bank.search.knn import check_search_backend
    monkeypatch.setattr(FS, "_faiss_module", lambda: None)
    base = torch.randn(10, 3)
    install = r"needs the faiss package.*`pip install faiss-cpu`"
    with pytest.raises(ImportError, match=r"^search_backend='faiss' " + install):
        iter_knn(base, base, 2, "faiss")  # the call itself, no next()
    with pytest.raises(ImportError, match=r"^search_backend='faiss' " + install):
        check_search_backend("faiss")
    assert check_search_backend("torch") == "torch"
    with pytest.raises(ImportError, match=r"^search_backend='faiss' " + install):
        nnkloss.NeighbourKernelClassifier(nnkloss.CentreBank(base, torch.arange(10) % 2), 2,
                                          1.0, search_backend="faiss")
    with pytest.raises(ImportError, match=r"^search_backend='faiss' " + install):
        nnkloss.evaluation.metrics.evaluate(base, torch.arange(10) % 2, (1,), search_backend="faiss")
    bad = base.clone()
    bad[3, 1] = math.nan  # the missing package is reported first, not the inputs
    for kind in ("ivf", "hnsw"):
        with pytest.raises(ImportError, match=rf"^approximate='{kind}' " + install):
            knn(bad, bad, 2, approximate=kind)
        with pytest.raises(ImportError, match=rf"^approximate='{kind}' " + install):
            recall_against_exact(bad, bad, 2, approximate=kind)


def test_gpu_probe_failure_warns_once_and_falls_back(monkeypatch):
    """A faiss GPU build that cannot run on the device (e.g. no sm_90 code) -> one warning."""
    class BrokenIndex:
        def __init__(self, *a):
            pass

        def add(self, x):
            pass

        def search(self, x, k):
            raise RuntimeError("CUDA error 209 no kernel image is available for execution\n"
                               "on the device")

    fake = types.SimpleNamespace(StandardGpuResources=lambda: object(), get_num_gpus=lambda: 1,
                                 GpuIndexFlatConfig=lambda: types.SimpleNamespace(device=0),
                                 GpuIndexFlatL2=BrokenIndex)
    monkeypatch.setattr(FS, "_faiss_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    FS.faiss_gpu_usable.cache_clear()
    FS._gpu_resources.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"faiss GPU index unusable on cuda:0 .*no kernel"):
            assert FS.faiss_gpu_usable(0) is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert FS.faiss_gpu_usable(0) is False  # cached: no second probe, no second warning
        assert not FS.use_faiss_gpu(torch.device("cuda", 0))
    finally:
        FS.faiss_gpu_usable.cache_clear()
        FS._gpu_resources.cache_clear()


# ----------------------------------------------------------------------------- approximate
def clustered(n, d, classes, seed):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, d, generator=g) * 10
    return means[torch.arange(n) % classes] + torch.randn(n, d, generator=g)


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_search_and_recall(kind):
    base = clustered(3000, 16, 20, seed=6)
    rec = recall_against_exact(base, base, 10, approximate=kind, sample=200, exclude_self=True)
    assert 0.0 <= rec <= 1.0
    assert rec > 0.9
    dist, idx = knn(base, base, 10, approximate=kind, exclude_self=True)
    assert dist.shape == (3000, 10) and idx.dtype == torch.int64
    assert (idx != torch.arange(3000)[:, None]).all()
    found = idx >= 0
    assert found.float().mean() > 0.95
    assert torch.isinf(dist[~found]).all()
    # Returned distances are true distances of the returned rows.
    q = torch.arange(0, 3000, 97)
    d_true = (base[idx[q].clamp_min(0)] - base[q, None]).pow(2).sum(-1)
    assert torch.allclose(dist[q][found[q]], d_true[found[q]], rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
def test_recall_is_low_when_the_index_is_starved():
    base = torch.randn(2000, 32, generator=torch.Generator().manual_seed(7))
    low = recall_against_exact(base, base, 20, approximate="ivf", sample=100, nlist=50, nprobe=1)
    high = recall_against_exact(base, base, 20, approximate="ivf", sample=100, nlist=50, nprobe=50)
    assert 0.0 <= low < high and high == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sample"):
        recall_against_exact(base, base, 5, sample=0)


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
@pytest.mark.parametrize("kind, name, bad", [
    ("hnsw", "hnsw_m", 0), ("hnsw", "hnsw_m", 1), ("hnsw", "hnsw_m", -1),
    ("hnsw", "ef_construction", 0), ("hnsw", "ef_search", -5),
    ("ivf", "nprobe", 0), ("ivf", "nprobe", -1), ("ivf", "nlist", 1.5), ("ivf", "train_size", 0)])
def test_approximate_index_parameters_are_checked(kind, name, bad):
    # Left to faiss, hnsw_m 0 aborted the process, 1 crashed it and -1 hung it; nprobe 0 / -1
    # failed in faiss's search with messages naming no argument; nlist 1.5 was truncated.
    base = torch.randn(60, 4, generator=torch.Generator().manual_seed(0))
    match = r"^hnsw_m must be >= 2" if (name, bad) == ("hnsw_m", 1) else rf"^{name} must be"
    with pytest.raises(ValueError, match=match):
        knn(base, base, 5, approximate=kind, **{name: bad})
    with pytest.raises(ValueError, match=match):
        recall_against_exact(base, base, 5, approximate=kind, sample=4, **{name: bad})


@pytest.mark.parametrize("kind, name, value", [
    ("hnsw", "nprobe", 3), ("hnsw", "nlist", 4), ("hnsw", "train_size", 50), ("hnsw", "seed", 1),
    ("ivf", "ef_search", 100), ("ivf", "hnsw_m", 8), ("ivf", "ef_construction", 40),
    (None, "nprobe", 3), (None, "nlist", 4), (None, "seed", 0), (None, "ef_search", 16),
    (None, "hnsw_m", 32)])
def test_index_options_of_another_index_are_refused(kind, name, value):
    """An IVF option given for HNSW or the exact search, or an HNSW one for IVF or the exact
    search, was ignored without a word (nprobe tuned nothing). Refused before faiss is asked
    for, naming the option and the index that does not use it."""
    base = torch.randn(60, 4, generator=torch.Generator().manual_seed(0))
    used = "the exact search" if kind is None else f"approximate='{kind}'"
    match = rf"^{name}={value!r} is an option of approximate='(ivf|hnsw)' only; {used}"
    with pytest.raises(ValueError, match=match):
        knn(base, base, 5, approximate=kind, **{name: value})
    with pytest.raises(ValueError, match=match):
        K.neighbour_lists(base, torch.arange(60) % 3, 5, approximate=kind, **{name: value})
    if kind is not None and name != "seed":  # recall's seed also picks its sample
        with pytest.raises(ValueError, match=match):
            recall_against_exact(base, base, 5, approximate=kind, sample=4, **{name: value})


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
def test_index_options_of_the_chosen_index_are_used():
    """Options of the index asked for still pass (defaults None: the documented values)."""
    base = torch.randn(400, 4, generator=torch.Generator().manual_seed(0))
    for kind, opts in (("ivf", dict(nlist=4, nprobe=4, train_size=200, seed=3)),
                       ("hnsw", dict(hnsw_m=8, ef_construction=40, ef_search=50))):
        dist, idx = knn(base, base, 5, approximate=kind, exclude_self=True, **opts)
        assert idx.shape == (400, 5) and bool((idx >= 0).all())
        assert recall_against_exact(base, base, 5, approximate=kind, sample=50, **opts) > 0.5
    index = FS.build_approximate(base, "hnsw", 5)
    assert index.hnsw.efConstruction == 64 and index.hnsw.efSearch == 64
    assert index.hnsw.nb_neighbors(1) == 32  # hnsw_m's default


def test_auto_backend_choice(monkeypatch):
    """"auto" is the torch search on every device, whatever faiss offers."""
    monkeypatch.setattr(FS, "faiss_gpu_usable", lambda index=0: True)
    for dev in (torch.device("cpu"), torch.device("cuda", 0)):
        assert K.resolve_search_backend("auto", dev) == "torch"
    assert K.resolve_search_backend("faiss", torch.device("cpu")) == "faiss"
    assert K.resolve_search_backend("auto") == "torch"  # the device is optional: never read
    with pytest.raises(ValueError, match="search_backend must be one of"):
        K.resolve_search_backend("annoy", torch.device("cpu"))


def lex_sorted(dist, idx):
    """Every row ascends in (distance, index)."""
    d0, d1, i0, i1 = dist[:, :-1], dist[:, 1:], idx[:, :-1], idx[:, 1:]
    return bool(((d0 < d1) | ((d0 == d1) & (i0 < i1))).all())


def tied(n=600, d=3, seed=8):
    """Small-integer points: every distance is exact in fp32 and most are tied."""
    return torch.randint(0, 3, (n, d), generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("tile_bytes", [None, 6000])
def test_ties_are_ordered_by_index(tile_bytes):
    x = tied()
    dist, idx = knn(x, x, 40, "torch", exclude_self=True, tile_bytes=tile_bytes)
    assert lex_sorted(dist, idx)
    # The same as sorting each row of the exact distances by (distance, index).
    full = (x[:, None] - x[None]).pow(2).sum(-1)
    full.fill_diagonal_(float("inf"))
    ref = torch.stack([torch.tensor(sorted(range(600), key=lambda j: (float(full[i, j]), j))[:40])
                       for i in range(0, 600, 37)])
    assert torch.equal(idx[::37], ref)


@pytest.mark.cuda
@pytest.mark.parametrize("tile_bytes", [None, 6000])
def test_the_gpu_search_gives_the_cpus_lists(tile_bytes):
    """The torch search on a GPU (the default there, with or without FAISS) gives the CPU's
    lists exactly where every distance is exact (small integers): the same selection, the same
    ties by index, own rows excluded; on random points the same distances to fp32 rounding."""
    x = tied(seed=10)
    cpu_d, cpu_i = knn(x, x, 40, "torch", exclude_self=True, tile_bytes=tile_bytes)
    gpu_d, gpu_i = knn(x.cuda(), x.cuda(), 40, "torch", exclude_self=True,
                       tile_bytes=tile_bytes)
    assert gpu_i.device.type == "cuda"
    assert torch.equal(gpu_i.cpu(), cpu_i) and torch.equal(gpu_d.cpu(), cpu_d)
    y = torch.randn(3000, 128, generator=torch.Generator().manual_seed(11))
    cpu_d, _ = knn(y, y, 100, "torch", exclude_self=True)
    gpu_d, _ = knn(y.cuda(), y.cuda(), 100, "torch", exclude_self=True)
    torch.testing.assert_close(gpu_d.cpu(), cpu_d, rtol=1e-4, atol=1e-3)


def test_auto_gives_the_same_neighbours_with_and_without_faiss(monkeypatch):
    """Issue 20: the digits demo's numbers changed when faiss was installed, because "auto"
    switched to faiss and the two searches broke distance ties differently."""
    x = tied(seed=9)
    with_faiss = knn(x, x, 25, exclude_self=True)
    monkeypatch.setattr(FS, "_faiss_module", lambda: None)
    without = knn(x, x, 25, exclude_self=True)
    assert torch.equal(with_faiss[1], without[1]) and torch.equal(with_faiss[0], without[0])


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
def test_exact_backends_agree_on_ties():
    """Exactly representable distances: torch and faiss return identical lists, ties included."""
    x = tied(seed=10)
    q = tied(n=50, seed=11)
    for queries, excl in ((x, True), (q, False)):
        a = knn(queries, x, 30, "torch", exclude_self=excl)
        b = knn(queries, x, 30, "faiss", exclude_self=excl)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@pytest.fixture
def torch_selection(monkeypatch):
    """The plain torch selection (the path for CUDA tensors and for a missing library)."""
    monkeypatch.setattr(cpu, "knn_selection", lambda *a: None)


@pytest.mark.parametrize("exclude_self", [False, True])
def test_sampled_threshold_path(monkeypatch, torch_selection, exclude_self):
    """The threshold from a column sample gives the exact result."""
    g = torch.Generator().manual_seed(12)
    base = torch.randn(1500, 10, generator=g)
    queries = base if exclude_self else torch.randn(90, 10, generator=g)
    # The running merge of the tiled path (tiny budget) never samples.
    exact = knn(queries, base, 30, "torch", exclude_self=exclude_self, tile_bytes=20_000)
    monkeypatch.setattr(TS, "SAMPLE_COLUMNS", 128)
    monkeypatch.setattr(TS, "MIN_SAMPLE_COLUMNS", 64)
    calls = []
    real = TS._knn_block
    monkeypatch.setattr(TS, "_knn_block", lambda *a: calls.append(a[2]) or real(*a))
    sampled = knn(queries, base, 30, "torch", exclude_self=exclude_self)
    assert calls and set(calls) == {128}  # the threshold came from a 128-column sample
    # Indices equal; distances up to the rounding of differently shaped GEMMs.
    assert torch.equal(exact[1], sampled[1])
    torch.testing.assert_close(exact[0], sampled[0])
    check_result(queries, base, 30, *sampled, exclude_self=exclude_self)
    # A sample rank far too low makes every row fall back to its exact threshold.
    monkeypatch.setattr(TS, "_sample_rank", lambda k, s, n: 1)
    fallback = knn(queries, base, 30, "torch", exclude_self=exclude_self)
    assert torch.equal(exact[1], fallback[1])


def test_sampled_path_with_ties(monkeypatch, torch_selection):
    monkeypatch.setattr(TS, "MIN_SAMPLE_COLUMNS", 16)
    x = tied(n=700, seed=13)
    dist, idx = knn(x, x, 35, "torch", exclude_self=True)
    monkeypatch.setattr(TS, "MIN_SAMPLE_COLUMNS", 10**9)  # exact threshold
    assert torch.equal(idx, knn(x, x, 35, "torch", exclude_self=True)[1])
    assert lex_sorted(dist, idx)


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_iter_knn_blocks_cover_the_queries(search_backend):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(400, 6, generator=g)
    whole = knn(x, x, 7, search_backend, exclude_self=True)
    seen = 0
    for q0, dist, idx in iter_knn(x, x, 7, search_backend, exclude_self=True, tile_bytes=30_000):
        assert q0 == seen
        assert torch.equal(idx, whole[1][q0:q0 + idx.shape[0]])
        seen += idx.shape[0]
    assert seen == 400


def test_results_are_distances_then_neighbours_everywhere():
    """One order and one name for search results (issue 19): knn returns the NamedTuple
    (distances, neighbours), iter_knn yields (row0, distances, neighbours), and NeighbourLists
    starts with the same two fields; its ``neighbours`` is what the bank installs."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(60, 5, generator=g)
    y = torch.arange(60) % 4
    res = knn(x, x, 6, "torch", exclude_self=True)
    assert isinstance(res, K.SearchResult) and res._fields == ("distances", "neighbours")
    assert res.distances.dtype == torch.float32 and res.neighbours.dtype == torch.int64
    assert (res.distances[:, 1:] >= res.distances[:, :-1]).all()     # distances first
    assert torch.equal(res[0], res.distances) and torch.equal(res[1], res.neighbours)
    block = next(iter(iter_knn(x, x, 6, "torch", exclude_self=True)))
    assert isinstance(block, K.SearchBlock)
    assert block._fields == ("row0", "distances", "neighbours") and block.row0 == 0
    rows = block.neighbours.shape[0]
    assert torch.equal(block.neighbours, res.neighbours[:rows])
    assert torch.equal(block.distances, res.distances[:rows])
    lists = K.neighbour_lists(x, y, 6, search_backend="torch")
    assert [f.name for f in dataclasses.fields(lists)][:2] == ["distances", "neighbours"]
    assert torch.equal(lists.neighbours, res.neighbours)
    assert torch.equal(lists.distances, res.distances)
    assert not hasattr(lists, "indices")
    bank = nnkloss.CentreBank(x, y)
    assert torch.equal(bank.rebuild_neighbours(6, search_backend="torch").neighbours,
                       bank.neighbours.long())


def test_drop_self():
    dist = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    ids = torch.tensor([[5, 0, 7], [3, 4, 6], [9, 8, 2]])
    d, i = drop_self(dist, ids, torch.tensor([0, 1, 2]), 2)
    # Own row removed where present (order kept); otherwise the last entry goes.
    assert i.tolist() == [[5, 7], [3, 4], [9, 8]]
    assert d.tolist() == [[0.0, 2.0], [0.0, 0.0], [1.0, 2.0]]


@pytest.mark.parametrize("k", [1, 4, 6])
def test_drop_self_against_a_row_by_row_reference(k):
    g = torch.Generator().manual_seed(k)
    q, width = 40, 7
    ids = torch.stack([torch.randperm(50, generator=g)[:width] + q for _ in range(q)])
    own = torch.arange(q)
    where = torch.randint(0, width + 1, (q,), generator=g)  # width: the own row is absent
    for r in range(q):
        if where[r] < width:
            ids[r, where[r]] = own[r]
    ids[-1, -2:] = -1  # padding at the end of a row (approximate search)
    dist = torch.sort(torch.rand(q, width, generator=g), dim=1).values
    dist[-1, -2:] = float("inf")
    d, i = drop_self(dist, ids, own, k)
    for r in range(q):
        keep = [j for j in range(width) if ids[r, j] != own[r]][:width - 1][:k]
        assert i[r].tolist() == ids[r, keep].tolist()
        assert d[r].tolist() == dist[r, keep].tolist()
    assert d.is_contiguous() and i.is_contiguous() and i.dtype == ids.dtype


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
def test_recall_rejects_unknown_parameters():
    base = torch.randn(100, 4)
    with pytest.raises(TypeError, match="nprob"):
        recall_against_exact(base, base, 3, approximate="ivf", nprob=4)


# ----------------------------------------------------------------------------- compiled selection
compiled = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: torch path only")


def ref_lists(queries, base, k, exclude_self=False):
    """The k nearest of every query by (distance, index), from fp64 distances (exact for the
    small-integer data used here) and a stable sort: equal distances keep base order."""
    q64, b64 = queries.double(), base.double()
    d = (q64[:, None, :] - b64[None]).pow(2).sum(-1)
    if exclude_self:
        d.fill_diagonal_(math.inf)
    dist, idx = d.sort(dim=1, stable=True)
    return dist[:, :k].float(), idx[:, :k]


class SelectionSpy:
    """Counts the compiled selection's tiles, so a test knows which path ran: ``tiles`` of the
    blockwise path ``(shape, col0)``, ``sym`` of the symmetric self-search
    ``(shape, row0, col0)``."""

    def __init__(self, monkeypatch):
        self.tiles, self.sym = [], []
        real = cpu.KnnSelection.add
        real_sym = cpu.KnnSelection.add_symmetric

        def add(sel, dist, col0):
            self.tiles.append((tuple(dist.shape), col0))
            return real(sel, dist, col0)

        def add_symmetric(sel, dist, row0, col0):
            self.sym.append((tuple(dist.shape), row0, col0))
            return real_sym(sel, dist, row0, col0)
        monkeypatch.setattr(cpu.KnnSelection, "add", add)
        monkeypatch.setattr(cpu.KnnSelection, "add_symmetric", add_symmetric)


def both_paths(monkeypatch, *args, **kw):
    """knn through the compiled selection (blockwise: the queries are not the base tensor,
    see symmetric_paths for a self-search), then through the torch fallback."""
    spy = SelectionSpy(monkeypatch)
    a = knn(*args, search_backend="torch", **kw)
    assert spy.tiles and not spy.sym, "the compiled blockwise selection did not run"
    with monkeypatch.context() as m:
        m.setattr(cpu, "knn_selection", lambda *a: None)
        n = len(spy.tiles)
        b = knn(*args, search_backend="torch", **kw)
        assert len(spy.tiles) == n and not spy.sym, "the fallback ran the compiled selection"
    return a, b


@compiled
@pytest.mark.parametrize("q_tile,b_tile", [(512, 2048), (7, 13), (1, 64), (5, 1)])
@pytest.mark.parametrize("n,k", [(40, 1), (40, 40), (200, 1), (200, 37), (211, 100),
                                 (211, 211)])
def test_compiled_selection_matches_reference_with_ties(monkeypatch, q_tile, b_tile, n, k):
    """Many exact ties (small-integer points): the lists are those of the (distance, index)
    sort, for k = 1 .. N, k wider than a base tile, N below / above / not a multiple of a
    tile, Q not a multiple of the query tile; the torch fallback returns the same lists."""
    monkeypatch.setattr(TS, "QUERY_TILE", q_tile)
    monkeypatch.setattr(TS, "BASE_TILE", b_tile)
    base = tied(n=n, d=3, seed=n + k)
    queries = tied(n=23, d=3, seed=k)
    a, b = both_paths(monkeypatch, queries, base, k)
    ref = ref_lists(queries, base, k)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
    assert torch.equal(b[1], ref[1]) and torch.equal(b[0], ref[0])


@compiled
@pytest.mark.parametrize("k", [1, 9, 299])
def test_compiled_selection_exclude_self(monkeypatch, k):
    """exclude_self through the blockwise compiled path: the queries are an equal copy of the
    base, not the same tensor (the same tensor takes the symmetric path, tested below)."""
    monkeypatch.setattr(TS, "QUERY_TILE", 16)
    monkeypatch.setattr(TS, "BASE_TILE", 48)
    x = tied(n=300, d=4, seed=20 + k)
    a, b = both_paths(monkeypatch, x.clone(), x, k, exclude_self=True)
    ref = ref_lists(x, x, k, exclude_self=True)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    it = list(iter_knn(x.clone(), x, k, "torch", exclude_self=True))
    assert [q0 for q0, _, _ in it] == list(range(0, 300, 16))
    assert torch.equal(torch.cat([i for _, _, i in it]), ref[1])


@compiled
def test_compiled_selection_small_budget(monkeypatch):
    """A tiny tile budget shrinks the query tile, then the base tile: still exact."""
    x = tied(n=500, d=3, seed=30)
    for budget in (3000, 40_000):
        tq, tb, cap = TS.cpu_tile_sizes(500, 500, 20, budget)
        assert tq * (tb * 4 + cap * 8 + 20 * 12) <= budget or (tq, tb) == (1, 1)
        a, b = both_paths(monkeypatch, x, x, 20, exclude_self=True, tile_bytes=budget)
        ref = ref_lists(x, x, 20, exclude_self=True)
        assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
        assert torch.equal(a[1], b[1])


@compiled
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_compiled_selection_input_dtypes(monkeypatch, dtype):
    monkeypatch.setattr(TS, "BASE_TILE", 64)
    base = tied(n=150, d=5, seed=40).to(dtype)
    queries = tied(n=31, d=5, seed=41).to(dtype)
    a, b = both_paths(monkeypatch, queries, base, 17)
    ref = ref_lists(queries, base, 17)
    assert a[0].dtype == torch.float32 and a[1].dtype == torch.int64
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@compiled
def test_compiled_selection_random_data_agrees_with_fallback(monkeypatch):
    """Random data, default tiles: the compiled path's tiles round every distance as the
    fallback's wider blocks do (MKL here); bit-equal lists, and correct against brute force."""
    g = torch.Generator().manual_seed(50)
    base = torch.randn(3000, 40, generator=g)
    queries = torch.randn(600, 40, generator=g)
    a, b = both_paths(monkeypatch, queries, base, 64)
    check_result(queries, base, 64, *a)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@compiled
def test_compiled_selection_clamps_negative_distances(monkeypatch):
    """Near-duplicates far from the origin: cancellation makes ||q||^2 - 2 q.b + ||b||^2
    negative or -0.0; they come back as +0.0, tied, ordered by index, on both paths."""
    g = torch.Generator().manual_seed(60)
    centre = torch.full((1, 16), 3000.0)
    base = centre + torch.randn(64, 16, generator=g) * 1e-3
    queries = base[:9] + torch.randn(9, 16, generator=g) * 1e-4
    a, b = both_paths(monkeypatch, queries, base, 64)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert (a[0].view(torch.int32) >= 0).all(), "no negative value and no -0.0"
    qa = TS._augment(queries, 24, query_side=True)
    # the distances as the search computes them (its GEMM: distance_tile)
    raw = TS.distance_tile(qa, TS._augment(base, 24, query_side=False), torch.empty(9, 64))
    assert (raw < 0).any() and (raw == 0).any()  # the case under test does occur
    zeros = a[0] == 0
    assert lex_sorted(a[0], a[1]) and zeros.sum() >= (raw <= 0).sum()


@compiled
def test_selection_state_orders_keys_exactly():
    """The C++ selection fed tiles directly: -0.0, negatives and +0.0 are all distance 0 and
    tie by index; equal distances across tiles keep base order; random widths of tiles."""
    g = torch.Generator().manual_seed(70)
    rows, n, k = 5, 997, 83
    dist = torch.randint(0, 6, (rows, n), generator=g).float()
    dist[0, 500:510] = -0.0
    dist[1, ::7] = -1e-6
    dist[2, 900:] = float("inf")
    sel = cpu.knn_selection(rows, k, k + 64)
    sel.reset(rows)
    c0 = 0
    while c0 < n:
        w = int(torch.randint(1, 200, (1,), generator=g))
        sel.add(dist[:, c0:c0 + w].contiguous(), c0)
        c0 += w
    d, i = sel.finish()
    clamped = dist.clamp_min(0.0) + 0.0
    ref_d, ref_i = clamped.sort(dim=1, stable=True)
    assert torch.equal(i, ref_i[:, :k])
    assert torch.equal(d.view(torch.int32), ref_d[:, :k].view(torch.int32))
    bad = cpu.knn_selection(1, 4, 4)
    bad.reset(1)  # (an add before any reset is refused: its counts are uninitialised)
    with pytest.raises(RuntimeError, match="nnk_knn_select failed"):
        bad.add(dist[:1], 0)  # cap must exceed k


@compiled
@pytest.mark.parametrize("order", ["random", "ascending", "descending", "tied", "clustered"])
@pytest.mark.parametrize("k", [600, 1001, 1023])
def test_selection_compaction_with_a_sampled_pivot_is_exact(order, k):
    """Buffers of at least 1,024 keys are compacted around a pivot from a sample of the buffer
    (csrc/search.cpp, KnnRow::compact), falling back to nth_element where the sample misleads:
    many compactions per row (N many times the buffer), in orders that make the sample
    representative (random), stale (ascending: the buffer keeps the first keys; descending:
    every key is a candidate) or tied (four distances: keys differ by index only), and one
    whose buffer holds two far groups (clustered). Buffers of 1,200, 2,002 and 2,046 keys: the
    AVX-512 count and partition take eight keys a step, the last 0, 2 and 6 one at a time. The
    lists are those of the (distance, index) sort."""
    g = torch.Generator().manual_seed(k)
    rows, n = 3, 12 * k
    base = torch.arange(n, dtype=torch.float32).repeat(rows, 1)
    dist = {"random": torch.rand(rows, n, generator=g),
            "ascending": base / n,
            "descending": (n - base) / n,
            "tied": torch.randint(0, 4, (rows, n), generator=g).float(),
            "clustered": torch.where(torch.rand(rows, n, generator=g) < 0.5,
                                     torch.rand(rows, n, generator=g) * 1e-3,
                                     1e3 + torch.rand(rows, n, generator=g))}[order]
    sel = cpu.knn_selection(rows, k, k + max(k, 64))
    sel.reset(rows)
    c0 = 0
    while c0 < n:
        w = int(torch.randint(1, 3 * k, (1,), generator=g))
        sel.add(dist[:, c0:c0 + w].contiguous(), c0)
        c0 += w
    d, i = sel.finish()
    ref_d, ref_i = dist.sort(dim=1, stable=True)
    assert torch.equal(i, ref_i[:, :k])
    assert torch.equal(d, ref_d[:, :k])


def test_fallback_when_the_kernel_is_switched_off(monkeypatch):
    """NNKLOSS_CPU_KERNEL=0: the search runs its torch selection, with the same lists."""
    x = tied(n=400, d=3, seed=80)
    ref = ref_lists(x, x, 30, exclude_self=True)
    monkeypatch.setenv("NNKLOSS_CPU_KERNEL", "0")
    cpu.build._reset_for_tests()
    try:
        with pytest.warns(RuntimeWarning, match="NNKLOSS_CPU_KERNEL=0"):
            dist, idx = knn(x, x, 30, "torch", exclude_self=True)
        assert cpu.knn_selection(4, 30, 94) is None
    finally:
        monkeypatch.delenv("NNKLOSS_CPU_KERNEL")
        cpu.build._reset_for_tests()
    assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])


# ------------------------------------------------------------ symmetric self-search (issue 21)
@compiled
def test_compiled_paths_drop_the_own_row_in_their_decode(monkeypatch):
    """With the compiled selection (blockwise and symmetric) the own row leaves each list in
    the decode (KnnSelection.finish's self0), not through a drop_self over each block; the torch
    selection still calls drop_self. The lists are the reference's on every path."""
    x = tied(n=300, d=3, seed=81)
    ref = ref_lists(x, x, 20, exclude_self=True)
    calls = []
    real = TS.drop_self
    monkeypatch.setattr(TS, "drop_self", lambda *a: calls.append(1) or real(*a))
    sym_blocks(monkeypatch, 64)
    spy = SelectionSpy(monkeypatch)
    for queries in (x, x.clone()):  # symmetric, then blockwise (an equal copy)
        dist, idx = knn(queries, x, 20, "torch", exclude_self=True, tile_bytes=2**22)
        assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])
    assert spy.sym and spy.tiles and not calls
    monkeypatch.setattr(cpu, "knn_selection", lambda *a: None)  # the torch selection
    dist, idx = knn(x, x, 20, "torch", exclude_self=True, tile_bytes=2**22)
    assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0]) and calls


@compiled
def test_compiled_paths_decode_into_knns_result(monkeypatch):
    """knn's result is allocated once: the compiled selection (blockwise and symmetric)
    decodes every block into its rows (the blocks it yields are views of it, no copy); the
    torch selection's blocks are its own and are copied in. The same lists on every path; a
    result of the wrong shape, dtype or layout is refused by KnnSelection.finish."""
    x = tied(n=300, d=3, seed=82)
    ref = ref_lists(x, x, 20, exclude_self=True)
    sym_blocks(monkeypatch, 64)
    seen = []
    real = TS.decoded_into
    knn_module = importlib.import_module("nnkloss.bank.search.knn")  # the name is knn's
    monkeypatch.setattr(knn_module, "decoded_into",
                        lambda *a: seen.append(real(*a)) or seen[-1])
    for queries, blocks in ((x, 5), (x.clone(), 1)):  # symmetric (blocks of 64), blockwise
        seen.clear()
        dist, idx = knn(queries, x, 20, "torch", exclude_self=True, tile_bytes=2**22)
        assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])
        assert len(seen) == blocks and all(seen)
    monkeypatch.setattr(cpu, "knn_selection", lambda *a: None)  # the torch selection
    seen.clear()
    dist, idx = knn(x, x, 20, "torch", exclude_self=True, tile_bytes=2**22)
    assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])
    assert seen and not any(seen)
    sel = cpu.search.knn_selection(4, 3, 70)  # the package name is patched
    sel.reset(4)
    sel.add(torch.rand(4, 10), 0)
    for bad in ((torch.empty(4, 2), torch.empty(4, 3, dtype=torch.long)),
                (torch.empty(4, 3, dtype=torch.float64), torch.empty(4, 3, dtype=torch.long)),
                (torch.empty(4, 3), torch.empty(3, 4, dtype=torch.long).t())):
        with pytest.raises(ValueError, match=r"out must hold contiguous \(4, 3\) fp32 and int64"):
            sel.finish(out=bad)


def sym_blocks(monkeypatch, s):
    """Blocks of s points in the symmetric self-search, so small data has several blocks, at
    any k (the rule on k, tested on its own below, would send the small widths of these
    tests' points to the blockwise path)."""
    monkeypatch.setattr(TS, "SYM_BLOCK", s)
    monkeypatch.setattr(TS, "SYM_MIN_BLOCK", 1)
    monkeypatch.setattr(TS, "SYM_MAX_K_PER_WIDTH", 10**6)


@compiled
@pytest.mark.parametrize("exclude_self", [False, True])
def test_symmetric_search_only_up_to_three_times_the_width(monkeypatch, exclude_self):
    """The symmetric self-search runs for k + exclude_self (the k searched) up to
    SYM_MAX_K_PER_WIDTH = 3 times the augmented width (D + 2 rounded up to 8), the blockwise
    path above it (slower there: docs/PERFORMANCE.md); the lists are the reference's on
    both sides of the bound."""
    assert TS.SYM_MAX_K_PER_WIDTH == 3
    monkeypatch.setattr(TS, "SYM_BLOCK", 64)
    monkeypatch.setattr(TS, "SYM_MIN_BLOCK", 1)
    x = tied(n=200, d=6, seed=85)  # width 8: k searched up to 24 symmetric
    bound = 24 - int(exclude_self)
    for k, symmetric in ((bound, True), (bound + 1, False)):
        spy = SelectionSpy(monkeypatch)
        dist, idx = knn(x, x, k, "torch", exclude_self=exclude_self)
        assert bool(spy.sym) == symmetric and bool(spy.tiles) != symmetric, k
        ref = ref_lists(x, x, k, exclude_self=exclude_self)
        assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])


def upper_tiles(n, s):
    """The tiles the symmetric search computes, in its order: (I, J), J >= I, I outer."""
    return [((min(s, n - i0), min(s, n - j0)), i0, j0)
            for i0 in range(0, n, s) for j0 in range(i0, n, s)]


@compiled
@pytest.mark.parametrize("n,s,k", [(200, 16, 9), (211, 32, 40), (300, 64, 150), (10, 16, 3),
                                   (50, 16, 49), (97, 8, 96), (2, 16, 1), (700, 200, 30)])
def test_symmetric_self_search_matches_reference(monkeypatch, n, s, k):
    """queries IS base, exclude_self: only the tiles on and above the diagonal get a GEMM, I
    outer and J inner; on exactly representable data with many ties the lists are those of the
    (distance, index) sort with the own row dropped, and those of the blockwise path (an equal
    copy as queries). N a multiple of S or not, N < S, N = k + 1 (every other point)."""
    sym_blocks(monkeypatch, s)
    x = tied(n=n, d=3, seed=n + s)
    spy = SelectionSpy(monkeypatch)
    a = knn(x, x, k, "torch", exclude_self=True)
    assert spy.sym == upper_tiles(n, s) and not spy.tiles
    assert a[0].dtype == torch.float32 and a[1].dtype == torch.int64
    ref = ref_lists(x, x, k, exclude_self=True)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
    assert (a[1] != torch.arange(n)[:, None]).all(), "a row returned itself"
    b = knn(x.clone(), x, k, "torch", exclude_self=True)
    assert spy.tiles, "an equal copy must take the blockwise path"
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@compiled
def test_symmetric_self_search_duplicates(monkeypatch):
    """Every point three times: the own row is dropped, its two twins come first (distance 0,
    by index), on the symmetric path with twins in other blocks."""
    sym_blocks(monkeypatch, 16)
    g = torch.Generator().manual_seed(90)
    x = torch.randint(0, 100, (40, 5), generator=g).float().repeat(3, 1)
    spy = SelectionSpy(monkeypatch)
    dist, idx = knn(x, x, 6, "torch", exclude_self=True)
    assert len(spy.sym) == len(upper_tiles(120, 16))
    assert (dist[:, :2] == 0).all() and (dist[:, 2] > 0).all()
    twins = torch.arange(120)[:, None] % 40 + torch.tensor([0, 40, 80])
    own = torch.arange(120)[:, None]
    expect = twins[twins != own].view(120, 2)  # the two other copies, ascending index
    assert torch.equal(idx[:, :2], expect)
    ref = ref_lists(x, x, 6, exclude_self=True)
    assert torch.equal(idx, ref[1]) and torch.equal(dist, ref[0])


@compiled
@pytest.mark.skipif(not HAVE_FAISS, reason="faiss missing")
def test_symmetric_self_search_agrees_with_faiss_on_ties(monkeypatch):
    sym_blocks(monkeypatch, 64)
    x = tied(n=600, seed=10)
    spy = SelectionSpy(monkeypatch)
    a = knn(x, x, 30, "torch", exclude_self=True)
    assert spy.sym
    b = knn(x, x, 30, "faiss", exclude_self=True)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@compiled
def test_symmetric_self_search_random_data(monkeypatch):
    """Random data: the distance of pair (i, j), i in an earlier block, comes from the tile
    computed with x_i as the query, for both lists, so it may differ by a rounding error from
    the blockwise path's. Distances within 1e-4 of the fp64 reference (check_result); indices
    equal to the blockwise path's except at near-ties, where the swapped neighbours' fp64
    distances differ by less than that tolerance."""
    sym_blocks(monkeypatch, 200)
    g = torch.Generator().manual_seed(91)
    x = torch.randn(700, 24, generator=g)
    spy = SelectionSpy(monkeypatch)
    a = knn(x, x, 30, "torch", exclude_self=True)
    assert len(spy.sym) == len(upper_tiles(700, 200))
    check_result(x, x, 30, *a, exclude_self=True)
    b = knn(x.clone(), x, 30, "torch", exclude_self=True)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    differ = a[1] != b[1]
    assert differ.float().mean() < 0.01
    x64 = x.double()
    rows = torch.arange(700)[:, None].expand(-1, 30)[differ]
    da = (x64[a[1][differ]] - x64[rows]).pow(2).sum(1)
    db = (x64[b[1][differ]] - x64[rows]).pow(2).sum(1)
    torch.testing.assert_close(da, db, rtol=1e-4, atol=1e-4)


def test_same_tensor():
    x = torch.randn(6, 6)
    assert TS.same_tensor(x, x) and TS.same_tensor(x, x[:]) and TS.same_tensor(x, x.view(6, 6))
    assert not TS.same_tensor(x, x.clone())           # equal values, other memory
    assert not TS.same_tensor(x, x.t())               # same memory and shape, other strides
    assert not TS.same_tensor(x, x[:5])               # other shape
    assert not TS.same_tensor(x, x.view(torch.int32))  # other dtype
    assert not TS.same_tensor(x[1:], x[:-1])          # same storage, other start


@compiled
def test_symmetric_path_only_for_the_same_tensor(monkeypatch):
    """The same memory under another Python object takes the symmetric path; an equal copy and
    a transposed view of a symmetric matrix (same memory and shape, other strides) take the
    blockwise path, with the same lists on exact data; so does an equal copy without
    exclude_self."""
    sym_blocks(monkeypatch, 16)
    x = tied(n=64, d=64, seed=92)
    sq = x @ x.t()  # symmetric (64, 64): sq.t() holds equal values with other strides
    ref = knn(x, x, 5, "torch", exclude_self=True)
    for queries, base, symmetric in ((x[:], x, True), (x.view(64, 64), x, True),
                                     (x.clone(), x, False), (sq.t(), sq, False)):
        spy = SelectionSpy(monkeypatch)
        res = knn(queries, base, 5, "torch", exclude_self=True)
        assert bool(spy.sym) == symmetric and bool(spy.tiles) != symmetric
        if base is x:
            assert torch.equal(res[1], ref[1]) and torch.equal(res[0], ref[0])
    spy = SelectionSpy(monkeypatch)
    knn(x.clone(), x, 5, "torch")  # no exclude_self, an equal copy: blockwise
    assert spy.tiles and not spy.sym


@compiled
@pytest.mark.parametrize("n,s,k", [(200, 16, 9), (211, 32, 40), (50, 16, 50), (10, 16, 3),
                                   (1, 16, 1)])
def test_symmetric_self_search_without_exclude_self(monkeypatch, n, s, k):
    """knn(x, x, k) without exclude_self is a self-search too: the symmetric path, each row
    its own first neighbour (distance 0, or an earlier exact twin), the lists of the
    (distance, index) sort and of the blockwise path, up to k = N (every point)."""
    sym_blocks(monkeypatch, s)
    x = tied(n=n, d=3, seed=n + 2 * s)
    spy = SelectionSpy(monkeypatch)
    a = knn(x, x, k, "torch")
    assert spy.sym == upper_tiles(n, s) and not spy.tiles
    ref = ref_lists(x, x, k)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])
    assert (a[0][:, 0] == 0).all()
    b = knn(x.clone(), x, k, "torch")
    assert spy.tiles, "an equal copy must take the blockwise path"
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_symmetric_block_bound(monkeypatch):
    """The whole state (n * (cap * 8 + 16) bytes), one (S, S) tile and one block's results
    must fit the budget; S halves down to SYM_MIN_BLOCK, else 0 (the blockwise path)."""
    assert TS.symmetric_block(100_000, 101, 256 * 2**20) == TS.SYM_BLOCK
    cap = 101 + 101
    state = 100_000 * (cap * 8 + 16)
    s = TS.SYM_BLOCK
    assert TS.symmetric_block(100_000, 101, state + s * (s * 4 + 101 * 12)) == s
    assert TS.symmetric_block(100_000, 101, state + s * (s * 4 + 101 * 12) - 1) == s // 2
    m = TS.SYM_MIN_BLOCK
    assert TS.symmetric_block(100_000, 101, state + m * (m * 4 + 101 * 12)) == m
    assert TS.symmetric_block(100_000, 101, state + m * (m * 4 + 101 * 12) - 1) == 0
    # The evaluation at 150,000 points with k + 1 = 1,501 (3.6 GB of state): blockwise.
    assert TS.symmetric_block(150_000, 1501, 2**30) == 0
    assert TS.symmetric_block(10, 3, 2**30) == 10  # N < S: one diagonal tile


@compiled
def test_symmetric_path_falls_back_when_the_state_does_not_fit(monkeypatch):
    x = tied(n=300, d=3, seed=93)
    spy = SelectionSpy(monkeypatch)
    small = knn(x, x, 20, "torch", exclude_self=True, tile_bytes=100_000)
    assert spy.tiles and not spy.sym
    big = knn(x, x, 20, "torch", exclude_self=True, tile_bytes=10**6)
    assert spy.sym
    assert torch.equal(small[1], big[1]) and torch.equal(small[0], big[0])


@compiled
def test_symmetric_blocks_stream_in_row_order(monkeypatch):
    """iter_knn yields block I as soon as its row of tiles is done (before any tile of block
    I + 1), in ascending row order; without the library the torch selection runs instead."""
    sym_blocks(monkeypatch, 32)
    x = tied(n=100, d=3, seed=94)
    spy = SelectionSpy(monkeypatch)
    seen = []
    for q0, dist, idx in iter_knn(x, x, 8, "torch", exclude_self=True):
        seen.append((q0, idx.shape[0], [t[1] for t in spy.sym]))
    assert [(q0, rows) for q0, rows, _ in seen] == [(0, 32), (32, 32), (64, 32), (96, 4)]
    for q0, _, row0s in seen:
        assert set(row0s) == set(range(0, q0 + 1, 32)), "a block yielded late or early"
    monkeypatch.setattr(cpu, "knn_selection", lambda *a: None)
    n = len(spy.sym)
    assert torch.equal(knn(x, x, 8, "torch", exclude_self=True)[1],
                       ref_lists(x, x, 8, exclude_self=True)[1])
    assert len(spy.sym) == n


def test_has_same_label_compiled_and_torch_forms_agree(monkeypatch):
    """The lists' has_positive on CPU (one compiled pass, each row read up to its first
    positive) and the torch form (every entry's label gathered), on a kNN graph with padding."""
    from nnkloss.bank.search.lists import has_same_label
    g = torch.Generator().manual_seed(2)
    centres = torch.randn(300, 3, generator=g)
    labels = torch.randint(0, 25, (300,), generator=g)
    nb = knn(centres, centres, 4, exclude_self=True).neighbours
    nb[::7, 1] = -1
    calls = []
    real = cpu.has_same_label
    monkeypatch.setattr(cpu, "has_same_label", lambda *a: calls.append(1) or real(*a))
    fast = has_same_label(nb, labels)
    monkeypatch.setattr(cpu, "has_same_label", lambda *a: None)
    slow = has_same_label(nb, labels)
    assert torch.equal(fast, slow) and 0 < int(fast.sum()) < 300
    assert calls or not cpu.available()


# ---------------------------------------------------------------------------- the tiles' GEMM
def test_distance_tile_takes_the_compiled_gemm_where_there_is_one(monkeypatch):
    """distance_tile: the library's GEMM on CPU tensors where it has one (its bits), torch.mm
    with COMPILED_GEMM off or where it has none; the same distances either way to rounding."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(70, 30, generator=g), torch.randn(90, 30, generator=g)
    qa, ba = TS._augment(x, 32, query_side=True), TS._augment(y, 32, query_side=False)
    ours = TS.distance_tile(qa, ba, torch.empty(70, 90))
    direct = torch.empty(70, 90)
    if cpu.gemm_nt(qa, ba, direct):
        assert torch.equal(ours, direct)
    else:
        assert torch.equal(ours, torch.mm(qa, ba.t()))
    monkeypatch.setattr(TS, "COMPILED_GEMM", False)
    called = []
    monkeypatch.setattr(cpu, "gemm_nt", lambda *a: called.append(1) or True)
    mm = TS.distance_tile(qa, ba, torch.empty(70, 90))
    assert not called and torch.equal(mm, torch.mm(qa, ba.t()))
    ref = torch.cdist(x.double(), y.double()).pow(2)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("compiled_gemm", [True, False])
def test_every_cpu_path_is_exact_with_either_gemm(monkeypatch, compiled_gemm):
    """The symmetric, blockwise-compiled and torch-selection paths, with the library's GEMM
    and with torch.mm: the (distance, index) lists of tied small-integer points."""
    monkeypatch.setattr(TS, "COMPILED_GEMM", compiled_gemm)
    x = tied(n=300, d=4, seed=11)
    ref = ref_lists(x, x, 25, exclude_self=True)
    sym = knn(x, x, 25, "torch", exclude_self=True)
    block = knn(x.clone(), x, 25, "torch", exclude_self=True)
    monkeypatch.setattr(cpu, "knn_selection", lambda *a: None)
    fallback = knn(x.clone(), x, 25, "torch", exclude_self=True)
    for got in (sym, block, fallback):
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
