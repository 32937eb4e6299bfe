"""Recall@K and MAP@R with exact duplicate points and distance ties (issue 14).

The own row is excluded by index, so an exact duplicate of the query is a neighbour at
distance 0. Among tied distances any order is a valid ranking: the metrics must lie between
the worst and the best tie-breaking, computed here by brute force. Integer coordinates keep
all distances exact in fp32, so "tied" means exactly tied.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nnkloss.evaluation import metrics


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
