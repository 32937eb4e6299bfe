"""Metrics against brute force with a full distance matrix (small data only), one search for
all of them, and equality with pytorch-metric-learning's AccuracyCalculator."""
import numpy as np
import pytest
import torch

import nnkloss
from nnkloss.evaluation import metrics
from nnkloss.bank.search import faiss_available

BACKENDS = ["torch"] + (["faiss"] if faiss_available() else [])


def data(n=150, d=8, classes=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    emb = torch.randn(n, d, generator=g) + 0.7 * torch.randn(classes, d, generator=g)[labels]
    return emb, labels


def brute_ranking(emb):
    """(N, N-1) other rows of each row, nearest first, from a full fp64 distance matrix."""
    d = torch.cdist(emb.double(), emb.double())
    d.fill_diagonal_(float("inf"))
    return d.argsort(dim=1)[:, :-1]


def brute_recall(emb, labels, ks):
    rank = brute_ranking(emb)
    return {k: (labels[rank[:, :k]] == labels[:, None]).any(1).double().mean().item() for k in ks}


def brute_map_at_r(emb, labels):
    rank = brute_ranking(emb)
    aps = []
    for i in range(emb.shape[0]):
        r = int((labels == labels[i]).sum()) - 1
        if r == 0:
            continue
        hits, total = 0, 0.0
        for pos in range(r):
            if labels[rank[i, pos]] == labels[i]:
                hits += 1
                total += hits / (pos + 1)
        aps.append(total / r)
    return float(np.mean(aps))


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_recall_at_k_matches_brute_force(search_backend):
    emb, labels = data()
    ks = (1, 2, 4, 8, 16)
    got = metrics.recall_at_k(emb, labels, ks, search_backend=search_backend)
    ref = brute_recall(emb, labels, ks)
    assert list(got) == list(ks)
    for k in ks:
        assert got[k] == pytest.approx(ref[k], abs=1e-12)
    assert all(got[a] <= got[b] for a, b in zip(ks, ks[1:]))


def test_recall_chunked_and_numpy():
    emb, labels = data(seed=1)
    full = metrics.recall_at_k(emb, labels, (1, 3, 5))
    # A tiny search budget: many blocks of query rows, each reduced as it comes.
    chunked = metrics.recall_at_k(emb.numpy(), labels.numpy(), (1, 3, 5), tile_bytes=4000)
    assert chunked == full


def test_recall_singletons_count_as_misses():
    emb = torch.tensor([[0.0], [0.1], [5.0]])
    labels = torch.tensor([0, 0, 1])
    assert metrics.recall_at_k(emb, labels, (1, 2)) == {1: 2 / 3, 2: 2 / 3}


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_map_at_r_matches_brute_force(search_backend):
    emb, labels = data(n=120, classes=9, seed=2)
    labels[0] = 50  # a singleton class: left out
    got = metrics.map_at_r(emb, labels, search_backend=search_backend)
    assert got == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)


def test_map_at_r_chunked():
    emb, labels = data(n=100, classes=4, seed=3)
    labels[:40] = 0  # uneven class sizes: R from ~19 to 39
    full = metrics.map_at_r(emb, labels)
    assert metrics.map_at_r(emb, labels, tile_bytes=3000) == pytest.approx(full, abs=1e-12)
    assert full == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)


def test_map_at_r_hand_computed():
    emb = torch.tensor([[0.0], [0.1], [0.25], [10.0], [10.1]])
    assert metrics.map_at_r(emb, torch.tensor([0, 0, 0, 1, 1])) == pytest.approx(1.0)
    # Class 0 = {0, 2, 4} (R = 2), class 1 = {1, 3} (R = 1). Rows 0, 2, 4 each find a miss then
    # a hit in their first two: (0 + 1/2) / 2 = 0.25. Rows 1 and 3 miss their one: 0.
    assert metrics.map_at_r(emb, torch.tensor([0, 1, 0, 1, 0])) == pytest.approx(0.15)


@pytest.mark.parametrize("kmeans_backend", ["sklearn", "torch"])
def test_nmi_separated_clusters_and_noise(kmeans_backend):
    g = torch.Generator().manual_seed(4)
    labels = torch.arange(6).repeat_interleave(50)
    centres = torch.randn(6, 10, generator=g) * 20
    emb = centres[labels] + torch.randn(300, 10, generator=g)
    assert metrics.nmi(emb, labels, kmeans_backend=kmeans_backend) > 0.99
    noise = torch.randint(0, 6, (300,), generator=g)
    assert metrics.nmi(emb, noise, kmeans_backend=kmeans_backend) < 0.1
    assert metrics.nmi(emb.numpy(), labels.numpy(), kmeans_backend=kmeans_backend) > 0.99


def test_nmi_is_deterministic_for_a_seed():
    emb, labels = data(seed=5)
    assert metrics.nmi(emb, labels, seed=3) == metrics.nmi(emb, labels, seed=3)


def test_accuracy():
    assert metrics.accuracy(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.75
    assert metrics.accuracy(np.array([0, 1]), np.array([0, 1])) == 1.0
    with pytest.raises(ValueError, match="shape"):
        metrics.accuracy(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(TypeError, match="pred"):
        metrics.accuracy(torch.tensor([1.0]), torch.tensor([1]))


def test_numpy_inputs_of_another_byte_order_read_only_or_without_a_torch_dtype():
    """A big-endian array (read from a file of that order) and a read-only one (np.load's
    memory map) evaluate as their native, writable copies, silently; a dtype torch has none of
    is a TypeError naming the argument (torch.from_numpy's errors named none)."""
    import warnings
    emb, labels = data(n=40)
    want = metrics.evaluate(emb, labels, (1, 2))
    e, lab = emb.numpy(), labels.numpy()
    big = e.astype(e.dtype.newbyteorder(">"))
    frozen = e.copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in ((big, lab), (frozen, lab), (e, lab.astype(lab.dtype.newbyteorder(">")))):
            assert metrics.evaluate(x, y, (1, 2)) == want
    with pytest.raises(TypeError, match=r"^labels has a numpy dtype torch cannot hold"):
        metrics.evaluate(e, lab.astype(object), (1, 2))


def test_validation_errors():
    emb, labels = data(n=20)
    with pytest.raises(ValueError, match="ks"):
        metrics.recall_at_k(emb, labels, (1, 20))
    with pytest.raises(ValueError, match="ks"):
        metrics.recall_at_k(emb, labels, (0,))
    for call in (metrics.recall_at_k, metrics.evaluate):  # ks=5 for (5,): named, not
        with pytest.raises(TypeError, match=r"^ks must be an iterable of ints"):  # "not iterable"
            call(emb, labels, 5)
    with pytest.raises(ValueError, match="labels"):
        metrics.recall_at_k(emb, labels[:5])
    with pytest.raises(TypeError, match="emb"):
        metrics.recall_at_k(emb.long(), labels)
    with pytest.raises(ValueError, match="search_backend"):
        metrics.map_at_r(emb, labels, search_backend="annoy")
    with pytest.raises(ValueError, match="no class"):
        metrics.map_at_r(emb, torch.arange(20))
    with pytest.raises(ValueError, match="kmeans_backend"):
        metrics.nmi(emb, labels, kmeans_backend="faiss")
    with pytest.raises(ValueError, match="n_init"):
        metrics.nmi(emb, labels, n_init=0)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        metrics.evaluate(emb, labels, (), map_at_r=False)
    with pytest.raises(ValueError, match="at least 2"):
        metrics.recall_at_k(emb[:1], labels[:1], (1,))
    # a NaN is named as the argument the caller passed (the search below says "queries"), by
    # every metric; an embedding of no column (every distance 0, every neighbour a tie) too
    bad = emb.clone()
    bad[7, 1] = float("nan")
    for call in (lambda e: metrics.evaluate(e, labels), lambda e: metrics.recall_at_k(e, labels),
                 lambda e: metrics.map_at_r(e, labels), lambda e: metrics.nmi(e, labels)):
        with pytest.raises(ValueError, match=r"^emb contains NaN or inf \(first bad row: 7\)$"):
            call(bad)
        with pytest.raises(ValueError, match=r"^emb must have at least one column \(D >= 1\)$"):
            call(emb[:, :0])


def test_rows_whose_distances_overflow_fp32_are_refused():
    # fp64 rows beyond fp32's range became inf in the search's fp32 distances and gave a
    # silently wrong number (recall 0.0 for a set whose every query's nearest is same-class)
    emb = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1e300, 0.0], [1e300, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"^emb has a row of norm 1e\+300 \(first such row: 2\)"):
        metrics.evaluate(emb, labels, (1,))
    emb[2:, 0] = 1e10  # the same set within range
    assert metrics.evaluate(emb, labels, (1,)) == {"recall@1": 1.0, "map@r": 1.0,
                                                   "r_precision": 1.0}


def test_exported():
    assert nnkloss.evaluation.metrics is metrics


# ----------------------------------------------------------------------------- one search
def brute_r_precision(emb, labels):
    rank = brute_ranking(emb)
    out = []
    for i in range(emb.shape[0]):
        r = int((labels == labels[i]).sum()) - 1
        if r:
            out.append(float((labels[rank[i, :r]] == labels[i]).double().mean()))
    return float(np.mean(out))


def test_evaluate_searches_once_for_every_metric(monkeypatch):
    emb, labels = data(n=130, classes=7, seed=6)
    calls = []
    real = metrics.iter_knn

    def counting(*args, **kwargs):
        calls.append(args[2])  # k
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, "iter_knn", counting)
    got = metrics.evaluate(emb, labels, (1, 2, 4, 8))
    r_max = int(torch.unique(labels, return_counts=True)[1].max()) - 1
    assert calls == [max(8, r_max)]  # one search, as deep as the deepest metric
    ref = brute_recall(emb, labels, (1, 2, 4, 8))
    for k in (1, 2, 4, 8):
        assert got[f"recall@{k}"] == pytest.approx(ref[k], abs=1e-12)
    assert got["map@r"] == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)
    assert got["r_precision"] == pytest.approx(brute_r_precision(emb, labels), abs=1e-12)
    assert set(got) == {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision"}


def test_progress_bar_only_when_asked(capsys):
    emb, labels = data(n=60, seed=7)
    metrics.evaluate(emb, labels, (1,))
    assert capsys.readouterr().err == ""
    metrics.evaluate(emb, labels, (1,), progress=True)
    assert "evaluate" in capsys.readouterr().err


def test_nmi_runs_n_init_kmeans(monkeypatch):
    import sklearn.cluster
    import nnkloss.bank.centroids as centroids

    emb, labels = data(n=90, classes=3, seed=8)
    seen = {}
    real_km = sklearn.cluster.KMeans

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_km(*args, **kwargs)

    monkeypatch.setattr(sklearn.cluster, "KMeans", spy)
    metrics.nmi(emb, labels)
    assert seen["n_init"] == 10  # the default: one run varies by several NMI points
    metrics.nmi(emb, labels, n_init=3)
    assert seen["n_init"] == 3
    seeds = []
    real_torch = centroids.kmeans

    def torch_spy(x, n, seed=0, **kw):
        seeds.append(seed)
        return real_torch(x, n, seed=seed, **kw)

    monkeypatch.setattr(metrics, "kmeans", torch_spy)
    metrics.nmi(emb, labels, seed=5, n_init=4, kmeans_backend="torch")
    assert seeds == [5, 6, 7, 8]


def tied_data(n=400, classes=6, seed=9):
    """Small-integer embeddings: exact fp32 distances with many ties."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    emb = (torch.randint(0, 3, (n, 4), generator=g) + labels[:, None] % 2).float()
    return emb, labels


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_equal_to_pytorch_metric_learning(search_backend):
    """Bit-equal to AccuracyCalculator (faiss flat index, k="max_bin_count") when both see the
    same distances: ranking by (distance, index), self-exclusion, MAP@R arithmetic."""
    pml = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    pytest.importorskip("faiss")
    rounded = data(n=300, classes=10, seed=10)
    rounded = (rounded[0].round(), rounded[1])  # integers: exact distances in both
    # classes of 2 to 60 members: R differs from row to row (the per-row ranks <= R mask)
    g = torch.Generator().manual_seed(11)
    uneven_labels = torch.repeat_interleave(torch.arange(8), torch.tensor([2, 3, 60, 5, 41, 2,
                                                                          30, 17]))
    uneven_labels = uneven_labels[torch.randperm(uneven_labels.numel(), generator=g)]
    uneven = (torch.randint(0, 4, (uneven_labels.numel(), 3), generator=g).float()
              + (uneven_labels[:, None] % 3), uneven_labels)
    for emb, labels in (tied_data(), rounded, uneven):
        calc = pml.AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r",
                                               "r_precision"), k="max_bin_count",
                                      device=torch.device("cpu"))
        ref = calc.get_accuracy(emb, labels)
        got = metrics.evaluate(emb, labels, (1,), search_backend=search_backend)
        assert got["recall@1"] == ref["precision_at_1"]  # no class of one: same denominators
        assert got["map@r"] == ref["mean_average_precision_at_r"]
        assert got["r_precision"] == ref["r_precision"]


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_metrics.py (issue 14 promises; issue 19).
# Recall@K and MAP@R with exact duplicate points and distance ties. The own row is excluded by
# index, so an exact duplicate of the query is a neighbour at distance 0. Among tied distances
# any order is a valid ranking: the metrics must lie between the worst and the best
# tie-breaking, computed here by brute force. Integer coordinates keep all distances exact in
# fp32, so "tied" means exactly tied.
from hypothesis import given, settings, strategies as st  # noqa: E402


def brute_bounds(emb, labels, rank_metric):
    """(worst, best) of ``rank_metric(order_of_same_flags, r)`` averaged over queries, the
    other rows of each query ordered by exact distance, ties broken against / for the query."""
    n = emb.shape[0]
    d = ((emb[:, None, :].double() - emb[None, :, :].double()) ** 2).sum(-1)
    worst, best, used = 0.0, 0.0, 0
    for q in range(n):
        others = [j for j in range(n) if j != q]
        same = {j: bool(labels[j] == labels[q]) for j in others}
        r = sum(same.values())
        val_w = rank_metric([same[j] for j in sorted(others, key=lambda j: (float(d[q, j]), same[j]))], r)
        val_b = rank_metric([same[j] for j in sorted(others, key=lambda j: (float(d[q, j]), not same[j]))], r)
        if val_w is None:
            continue
        worst, best, used = worst + val_w, best + val_b, used + 1
    return worst / used, best / used


def recall_metric(k):
    return lambda flags, r: float(any(flags[:k]))


def ap_at_r(flags, r):
    if r == 0:
        return None
    hits, total = 0, 0.0
    for pos, ok in enumerate(flags[:r]):
        if ok:
            hits += 1
            total += hits / (pos + 1)
    return total / r


def test_exact_duplicates_are_neighbours():
    # Two classes, each a pair of identical points; a singleton class 2 close to class 0.
    emb = torch.tensor([[0.0, 0.0], [0.0, 0.0], [10.0, 0.0], [10.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1, 1, 2])
    got = metrics.recall_at_k(emb, labels, (1, 2), search_backend="torch")
    assert got == {1: pytest.approx(4 / 5), 2: pytest.approx(4 / 5)}
    assert metrics.map_at_r(emb, labels, search_backend="torch") == pytest.approx(1.0)


def test_own_row_never_counts_among_ties():
    # Four identical points of four different classes: every neighbour within distance 0 is
    # of another class whatever the tie order; the own row (also at 0) must not count.
    emb = torch.cat([torch.zeros(4, 3), torch.arange(1, 5).float()[:, None] * 10 * torch.ones(1, 3)])
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    got = metrics.recall_at_k(emb, labels, (1, 2, 3), search_backend="torch")
    # Queries 0-3: 3 other-class points at distance 0 first; their partner comes 4th.
    # Queries 4-7: the nearest is the origin group (ties of 4, one of them same-class) or a
    # neighbour on the diagonal: compare with the brute-force bounds instead.
    for k in (1, 2, 3):
        lo, hi = brute_bounds(emb, labels, recall_metric(k))
        assert lo - 1e-12 <= got[k] <= hi + 1e-12, (k, got[k], lo, hi)
        assert got[k] <= 0.5  # no origin query finds a same-class item within 3
    m = metrics.map_at_r(emb, labels, search_backend="torch")
    lo, hi = brute_bounds(emb, labels, ap_at_r)
    assert lo - 1e-12 <= m <= hi + 1e-12


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 12).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=2), min_size=n, max_size=n),
    st.lists(st.integers(0, 2), min_size=n, max_size=n))))
def test_metrics_within_tie_breaking_bounds(case):
    coords, labs = case
    emb = torch.tensor(coords, dtype=torch.float32)
    labels = torch.tensor(labs)
    n = len(labs)
    ks = [k for k in (1, 2, 3, 5) if k <= n - 1]
    got = metrics.recall_at_k(emb, labels, ks, search_backend="torch")
    assert list(got) == ks
    for k in ks:
        lo, hi = brute_bounds(emb, labels, recall_metric(k))
        assert lo - 1e-12 <= got[k] <= hi + 1e-12, (k, got[k], lo, hi)
    if len(set(labs)) < n:  # some class has two members: MAP@R defined
        m = metrics.map_at_r(emb, labels, search_backend="torch")
        lo, hi = brute_bounds(emb, labels, ap_at_r)
        assert lo - 1e-12 <= m <= hi + 1e-12, (m, lo, hi)
    else:
        with pytest.raises(ValueError, match="MAP@R"):
            metrics.map_at_r(emb, labels, search_backend="torch")
def test_retrieval_metrics_reports_map_at_r_from_the_one_search(monkeypatch):
    """experiment.evaluate.retrieval_metrics (the repro scripts' numbers): Recall@K, MAP@R and
    R-precision from one search (metrics.evaluate), NMI from k-means with the given seed."""
    from nnkloss.experiment.evaluate import retrieval_metrics
    emb, labels = data(n=130, classes=7, seed=6)
    calls = []
    real = metrics.iter_knn

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, "iter_knn", counting)
    got = retrieval_metrics(emb, labels, seed=3)
    assert len(calls) == 1
    assert set(got) == {"recall@1", "recall@2", "recall@4", "recall@8", "map@r",
                        "r_precision", "nmi"}
    ref = brute_recall(emb, labels, (1, 2, 4, 8))
    for k in (1, 2, 4, 8):
        assert got[f"recall@{k}"] == pytest.approx(ref[k], abs=1e-12)
    assert got["map@r"] == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)
    assert got["r_precision"] == pytest.approx(brute_r_precision(emb, labels), abs=1e-12)
    assert got["nmi"] == metrics.nmi(emb, labels, seed=3)


def test_retrieval_metrics_on_too_small_sets_reports_none_with_warnings():
    from nnkloss.experiment.evaluate import retrieval_metrics
    emb = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"Recall@K for K = \[8\] skipped"):
        got = retrieval_metrics(emb, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert got["recall@8"] is None and got["recall@4"] is not None
    assert 0.0 <= got["map@r"] <= 1.0 and got["r_precision"] is not None
    with pytest.warns(UserWarning, match="no class of the evaluation set has two members"):
        got = retrieval_metrics(emb, torch.arange(6), ks=(1, 2))
    assert got["map@r"] is None and got["r_precision"] is None
    assert got["recall@1"] == 0.0 and got["nmi"] is not None
    with pytest.warns(UserWarning):
        got = retrieval_metrics(emb[:1], torch.tensor([0]), ks=(1,))
    assert got == {"recall@1": None, "map@r": None, "r_precision": None, "nmi": None}


def test_evaluate_takes_the_symmetric_search(symmetric_tiles):
    """evaluate searches the embeddings against themselves as one tensor (numpy input too):
    the symmetric self-search on the CPU (issue 21), with the brute-force metrics."""
    calls = symmetric_tiles
    emb, labels = data(n=130, classes=7, seed=6)
    for e in (emb, emb.numpy()):
        calls.clear()
        got = metrics.evaluate(e, labels, (1, 2, 4, 8))
        assert calls == [(i, j) for i in range(0, 130, 32) for j in range(i, 130, 32)]
        ref = brute_recall(emb, labels, (1, 2, 4, 8))
        for k in (1, 2, 4, 8):
            assert got[f"recall@{k}"] == pytest.approx(ref[k], abs=1e-12)
        assert got["map@r"] == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)


def test_evaluation_at_150k_stays_blockwise():
    """The symmetric search holds the selection state of every row: at 150,000 rows and
    K = 1,500 (k + 1 = 1,501 searched, cap 3,002 keys) that is 3.6 GB, over the evaluation's
    1 GiB budget, so the evaluation keeps the blockwise path, whose working set fits it."""
    from nnkloss.bank.search import torch_search as TS
    budget = metrics._EVAL_CPU_TILE_BYTES
    assert TS.symmetric_block(150_000, 1501, budget) == 0
    tq, tb, cap = TS.cpu_tile_sizes(150_000, 150_000, 1501, budget)
    assert tq * (tb * 4 + cap * 8 + 1501 * 12) <= budget
    assert TS.symmetric_block(150_000, 9, budget) > 0  # shallow metrics: 90 MB of state
