"""Metrics against brute force with a full distance matrix (small data only)."""
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_recall_at_k_matches_brute_force(backend):
    emb, labels = data()
    ks = (1, 2, 4, 8, 16)
    got = metrics.recall_at_k(emb, labels, ks, backend=backend)
    ref = brute_recall(emb, labels, ks)
    assert list(got) == list(ks)
    for k in ks:
        assert got[k] == pytest.approx(ref[k], abs=1e-12)
    assert all(got[a] <= got[b] for a, b in zip(ks, ks[1:]))


def test_recall_chunked_and_numpy(monkeypatch):
    emb, labels = data(seed=1)
    full = metrics.recall_at_k(emb, labels, (1, 3, 5))
    monkeypatch.setattr(metrics, "_RESULT_ELEMS", 40)  # chunks of ~6 query rows
    chunked = metrics.recall_at_k(emb.numpy(), labels.numpy(), (1, 3, 5))
    assert chunked == full


def test_recall_singletons_count_as_misses():
    emb = torch.tensor([[0.0], [0.1], [5.0]])
    labels = torch.tensor([0, 0, 1])
    assert metrics.recall_at_k(emb, labels, (1, 2)) == {1: 2 / 3, 2: 2 / 3}


@pytest.mark.parametrize("backend", BACKENDS)
def test_map_at_r_matches_brute_force(backend):
    emb, labels = data(n=120, classes=9, seed=2)
    labels[0] = 50  # a singleton class: left out
    got = metrics.map_at_r(emb, labels, backend=backend)
    assert got == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)


def test_map_at_r_chunked(monkeypatch):
    emb, labels = data(n=100, classes=4, seed=3)
    labels[:40] = 0  # uneven class sizes: R from ~19 to 39
    full = metrics.map_at_r(emb, labels)
    monkeypatch.setattr(metrics, "_RESULT_ELEMS", 64)
    assert metrics.map_at_r(emb, labels) == pytest.approx(full, abs=1e-12)
    assert full == pytest.approx(brute_map_at_r(emb, labels), abs=1e-12)


def test_map_at_r_hand_computed():
    emb = torch.tensor([[0.0], [0.1], [0.25], [10.0], [10.1]])
    assert metrics.map_at_r(emb, torch.tensor([0, 0, 0, 1, 1])) == pytest.approx(1.0)
    # Class 0 = {0, 2, 4} (R = 2), class 1 = {1, 3} (R = 1). Rows 0, 2, 4 each find a miss then
    # a hit in their first two: (0 + 1/2) / 2 = 0.25. Rows 1 and 3 miss their one: 0.
    assert metrics.map_at_r(emb, torch.tensor([0, 1, 0, 1, 0])) == pytest.approx(0.15)


@pytest.mark.parametrize("kmeans", ["sklearn", "torch"])
def test_nmi_separated_clusters_and_noise(kmeans):
    g = torch.Generator().manual_seed(4)
    labels = torch.arange(6).repeat_interleave(50)
    centres = torch.randn(6, 10, generator=g) * 20
    emb = centres[labels] + torch.randn(300, 10, generator=g)
    assert metrics.nmi(emb, labels, kmeans=kmeans) > 0.99
    noise = torch.randint(0, 6, (300,), generator=g)
    assert metrics.nmi(emb, noise, kmeans=kmeans) < 0.1
    assert metrics.nmi(emb.numpy(), labels.numpy(), kmeans=kmeans) > 0.99


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


def test_validation_errors():
    emb, labels = data(n=20)
    with pytest.raises(ValueError, match="ks"):
        metrics.recall_at_k(emb, labels, (1, 20))
    with pytest.raises(ValueError, match="ks"):
        metrics.recall_at_k(emb, labels, (0,))
    with pytest.raises(ValueError, match="labels"):
        metrics.recall_at_k(emb, labels[:5])
    with pytest.raises(TypeError, match="emb"):
        metrics.recall_at_k(emb.long(), labels)
    with pytest.raises(ValueError, match="backend"):
        metrics.map_at_r(emb, labels, backend="annoy")
    with pytest.raises(ValueError, match="no class"):
        metrics.map_at_r(emb, torch.arange(20))
    with pytest.raises(ValueError, match="kmeans"):
        metrics.nmi(emb, labels, kmeans="faiss")
    with pytest.raises(ValueError, match="at least 2"):
        metrics.recall_at_k(emb[:1], labels[:1], (1,))


def test_exported():
    assert nnkloss.evaluation.metrics is metrics
