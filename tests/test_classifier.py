"""NeighbourKernelClassifier against plain fp64 loops written from Eq. 3 (NNGK) and Eq. 14 (CCKNN)."""
import math

import numpy as np
import pytest
import torch

import nnkloss
from nnkloss import CentreBank, NeighbourKernelClassifier
from nnkloss.evaluation.classifier import RULES
from nnkloss.bank.search import faiss_available

BACKENDS = ["torch"] + (["faiss"] if faiss_available() else [])


def ref_nngk_proba(x, centres, labels, weights, k, sigma, num_classes):
    """Row by row: the k nearest centres by exact fp64 distance, Eq. 3 with a max shift."""
    x, centres, weights = x.double(), centres.double(), weights.double()
    keep = [j for j in range(centres.shape[0]) if float(weights[j]) > 0]
    out = torch.zeros(x.shape[0], num_classes, dtype=torch.float64)
    for b in range(x.shape[0]):
        d = {j: float(((x[b] - centres[j]) ** 2).sum()) for j in keep}
        near = sorted(keep, key=lambda j: d[j])[:k]
        logit = {j: math.log(float(weights[j])) - d[j] / (2 * sigma ** 2) for j in near}
        m = max(logit.values())
        den = sum(math.exp(v - m) for v in logit.values())
        for j in near:
            out[b, int(labels[j])] += math.exp(logit[j] - m) / den
    return out


def ref_ccknn(x, centres, labels, k, sigma, num_classes):
    """Per class: mean of its own min(k, n_C) smallest squared distances; Eq. 10-style softmax."""
    x, centres = x.double(), centres.double()
    score = torch.full((x.shape[0], num_classes), -math.inf, dtype=torch.float64)
    for b in range(x.shape[0]):
        for c in sorted(set(labels.tolist())):
            d = sorted(float(((x[b] - centres[j]) ** 2).sum())
                       for j in range(centres.shape[0]) if int(labels[j]) == c)
            kc = min(k, len(d))
            score[b, c] = -sum(d[:kc]) / kc / (2 * sigma ** 2)
    return torch.softmax(score, dim=1), score.argmax(1)


def make_bank(n=60, d=6, classes=5, seed=0, weights=False):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n, d, generator=g) * 2
    labels = torch.randint(0, classes, (n,), generator=g)
    labels[:classes] = torch.arange(classes)  # every class present
    w = torch.rand(n, generator=g) * 2 + 0.1 if weights else None
    return CentreBank(centres, labels, weights=w)


@pytest.mark.parametrize("search_backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_nngk_matches_reference(search_backend, weighted):
    bank = make_bank(weights=weighted)
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(1)) * 2
    clf = NeighbourKernelClassifier(bank, k=7, sigma=1.3, search_backend=search_backend,
                                    batch_size=16)
    p = clf.predict_proba(x)
    ref = ref_nngk_proba(x, bank.centres, bank.centre_labels, bank.weights.detach(), 7, 1.3,
                         bank.num_classes)
    assert p.shape == (40, bank.num_classes) and p.dtype == torch.float32
    torch.testing.assert_close(p.double(), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(p.sum(1), torch.ones(40))
    assert torch.equal(clf.predict(x), p.argmax(1))
    assert clf.predict(x).dtype == torch.int64


def test_fp64_queries_and_numpy_input():
    bank = make_bank(weights=True)
    x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    clf = NeighbourKernelClassifier(bank, k=5, sigma=0.8, search_backend="torch")
    p = clf.predict_proba(x)
    assert p.dtype == torch.float64
    ref = ref_nngk_proba(x, bank.centres, bank.centre_labels, bank.weights.detach(), 5, 0.8,
                         bank.num_classes)
    torch.testing.assert_close(p, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(clf.predict_proba(x.numpy()), p)


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_far_away_queries_give_no_nan(search_backend):
    # Two centres equidistant from a far query: every kernel value underflows (d ~ 1e8), but
    # the weighted vote is still exactly w_0 : w_1.
    centres = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 5.0]])
    bank = CentreBank(centres, torch.tensor([0, 1, 2]), weights=torch.tensor([1.0, 3.0, 1.0]))
    x = torch.tensor([[0.0, -1e4], [0.0, 1e4]])
    for rule in ("nngk", "ccknn"):
        clf = NeighbourKernelClassifier(bank, k=2, sigma=1.0, search_backend=search_backend,
                                        rule=rule)
        p = clf.predict_proba(x)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.sum(1), torch.ones(2))
    p = NeighbourKernelClassifier(bank, k=2, sigma=1.0,
                                  search_backend=search_backend).predict_proba(x)
    torch.testing.assert_close(p[0], torch.tensor([0.25, 0.75, 0.0]))
    # The second query's two nearest are centre 2 (much closer) and one of the others.
    assert p[1, 2] == 1.0
    # CCKNN (no weights in Eq. 14): classes 0 and 1 tie, class 2 is 1e5 further in sum.
    p = NeighbourKernelClassifier(bank, k=2, sigma=1.0, search_backend=search_backend,
                                  rule="ccknn").predict_proba(x[:1])
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.5, 0.0]))
    # Random far queries against the reference.
    bank = make_bank(weights=True)
    xf = torch.randn(12, 6, generator=torch.Generator().manual_seed(3)) * 300
    p = NeighbourKernelClassifier(bank, k=9, sigma=2.0,
                                  search_backend=search_backend).predict_proba(xf)
    ref = ref_nngk_proba(xf, bank.centres, bank.centre_labels, bank.weights.detach(), 9, 2.0,
                         bank.num_classes)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.double(), ref, atol=1e-5, rtol=1e-4)


def test_zero_weight_centre_is_not_a_neighbour():
    centres = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    bank = CentreBank(centres, torch.tensor([0, 1, 2]), weights=torch.tensor([0.0, 1.0, 1.0]))
    clf = NeighbourKernelClassifier(bank, k=1, sigma=1.0, search_backend="torch")
    # Centre 0 is nearest but has weight 0: the single neighbour is centre 1.
    assert clf.predict(torch.tensor([[0.0, 0.0]])).tolist() == [1]
    p = clf.predict_proba(torch.tensor([[0.0, 0.0]]))
    assert p[0].tolist() == [0.0, 1.0, 0.0]


def test_k_of_every_centre_means_all_centres_and_beyond_is_refused_naming_k():
    """k = N uses every centre (the NCM case); k > N is a ValueError naming k, as knn,
    rebuild_neighbours and the Refresher refuse it (it was clamped to N without a word):
    at construction, and at a call where the bank has shrunk or its centres of weight > 0
    are fewer than k."""
    bank = make_bank(n=12)
    x = torch.randn(5, 6)
    p = NeighbourKernelClassifier(bank, k=12, sigma=1.5, search_backend="torch").predict_proba(x)
    ref = ref_nngk_proba(x, bank.centres, bank.centre_labels, bank.weights.detach(), 12, 1.5,
                         bank.num_classes)
    torch.testing.assert_close(p.double(), ref, atol=1e-5, rtol=1e-4)
    for rule in RULES:
        with pytest.raises(ValueError, match=r"k=13 is larger than the bank's 12 centres"):
            NeighbourKernelClassifier(bank, k=13, sigma=1.0, rule=rule)
    clf = NeighbourKernelClassifier(bank, k=12, sigma=1.0, search_backend="torch")
    bank.update_(weights=torch.cat([torch.zeros(2), torch.ones(10)]))
    with pytest.raises(ValueError, match=r"k=12 is larger than the bank's 10 centres of weight > 0"):
        clf.predict(x)
    bank.update_(centres=bank.centres[:8], centre_labels=bank.centre_labels[:8],
                 weights=torch.ones(8))
    with pytest.raises(ValueError, match=r"k=12 is larger than the bank's 8 centres"):
        clf.predict(x, neighbours=torch.zeros(5, 12, dtype=torch.long))

def test_absent_labels_get_zero_probability():
    bank = CentreBank(torch.tensor([[0.0], [2.0]]), torch.tensor([0, 3]))
    p = NeighbourKernelClassifier(bank, k=2, sigma=1.0, search_backend="torch").predict_proba(
        torch.tensor([[1.5]]))
    assert p.shape == (1, 4)
    assert p[0, 1] == 0 and p[0, 2] == 0 and p[0, 3] > p[0, 0]


def test_ncm_special_case():
    # Bank = class means, k = number of classes, 1/(2 sigma^2) = 1/2: Mensink's NCM,
    # p(c|x) = softmax_c(-||x - mu_c||^2 / 2), prediction = nearest mean.
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(200, 5, generator=g)
    labels = torch.randint(0, 6, (200,), generator=g)
    emb = emb + labels[:, None].float() * 0.3  # some structure
    bank = CentreBank.from_class_means(emb, labels)
    x = torch.randn(50, 5, generator=g) + 0.8
    clf = NeighbourKernelClassifier(bank, k=bank.num_classes, sigma=1.0, search_backend="torch")
    d = torch.cdist(x.double(), bank.centres.double()) ** 2
    assert torch.equal(clf.predict(x), d.argmin(1))
    torch.testing.assert_close(clf.predict_proba(x).double(), torch.softmax(-d / 2, 1),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("search_backend", BACKENDS)
def test_ccknn_matches_eq14(search_backend):
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(40, 4, generator=g)
    labels = torch.cat([torch.zeros(15), torch.ones(20), torch.full((3,), 2.0),
                        torch.full((2,), 4.0)]).long()  # class 3 absent, classes 2 and 4 < k
    bank = CentreBank(centres, labels)
    x = torch.randn(25, 4, generator=g)
    clf = NeighbourKernelClassifier(bank, k=4, sigma=0.9, search_backend=search_backend,
                                    rule="ccknn",
                                    batch_size=7)
    p = clf.predict_proba(x)
    ref_p, ref_pred = ref_ccknn(x, centres, labels, 4, 0.9, 5)
    torch.testing.assert_close(p.double(), ref_p, atol=1e-5, rtol=1e-4)
    assert torch.equal(clf.predict(x), ref_pred)
    assert (p[:, 3] == 0).all()


def test_ccknn_eq14_is_sum_of_k_nearest_per_class():
    # Class 0 has the single nearest centre but class 1's 3 nearest are closer in sum:
    # plain 1-NN says 0, Eq. 14 with k=3 says 1.
    centres = torch.tensor([[0.1], [5.0], [6.0], [0.5], [0.6], [0.7]])
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    bank = CentreBank(centres, labels)
    x = torch.tensor([[0.0]])
    assert NeighbourKernelClassifier(bank, k=1, sigma=1.0, search_backend="torch").predict(x) == 0
    assert NeighbourKernelClassifier(bank, k=3, sigma=1.0, search_backend="torch",
                                     rule="ccknn").predict(x) == 1


def test_bank_growth_is_seen_at_once():
    bank = make_bank()
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0, search_backend="torch")
    far = torch.full((1, 6), 50.0)
    bank.add(far, torch.tensor([9]))
    assert clf.predict_proba(far).shape == (1, 10)
    assert clf.predict(far).item() == 9


def test_validation_errors():
    bank = make_bank()
    with pytest.raises(TypeError, match="bank"):
        NeighbourKernelClassifier(torch.zeros(3), k=1, sigma=1.0)
    with pytest.raises(ValueError, match="k must"):
        NeighbourKernelClassifier(bank, k=0, sigma=1.0)
    with pytest.raises(ValueError, match="sigma"):
        NeighbourKernelClassifier(bank, k=1, sigma=-1.0)
    with pytest.raises(ValueError, match="rule"):
        NeighbourKernelClassifier(bank, k=1, sigma=1.0, rule="knn")
    with pytest.raises(ValueError, match="search_backend"):
        NeighbourKernelClassifier(bank, k=1, sigma=1.0, search_backend="annoy")
    with pytest.raises(ValueError, match="batch_size"):
        NeighbourKernelClassifier(bank, k=1, sigma=1.0, batch_size=0)
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0)
    with pytest.raises(ValueError, match="dimension"):
        clf.predict(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="emb"):
        clf.predict(torch.full((2, 6), float("nan")))
    with pytest.raises(TypeError, match="emb"):
        clf.predict(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="emb"):
        clf.predict([[0.0] * 6])
    zero = CentreBank(torch.zeros(2, 6), torch.tensor([0, 1]), weights=torch.zeros(2))
    with pytest.raises(RuntimeError, match="weight 0"):
        NeighbourKernelClassifier(zero, k=1, sigma=1.0).predict(torch.zeros(1, 6))


def test_is_a_module_and_exported():
    bank = make_bank()
    clf = nnkloss.NeighbourKernelClassifier(bank, k=3, sigma=1.0)
    assert isinstance(clf, torch.nn.Module)
    assert "bank.centres" in clf.state_dict()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    torch.testing.assert_close(clf(x), clf.predict_proba(torch.from_numpy(x)))


def test_precomputed_neighbours_skip_the_search(monkeypatch):
    """An evaluation that already searched passes its neighbours: same probabilities, no
    second search."""
    import nnkloss.evaluation.classifier as C

    bank = make_bank(weights=True)
    x = torch.randn(30, 6, generator=torch.Generator().manual_seed(3)) * 2
    clf = NeighbourKernelClassifier(bank, k=6, sigma=1.1, batch_size=8)
    expected = clf.predict_proba(x)
    _, nb = nnkloss.knn(x, bank.centres, 9)  # deeper than k: the first k columns are used

    def no_search(*a, **kw):
        raise AssertionError("searched again")

    monkeypatch.setattr(C, "knn", no_search)
    torch.testing.assert_close(clf.predict_proba(x, neighbours=nb), expected)
    assert torch.equal(clf.predict(x, neighbours=nb.numpy()), expected.argmax(1))
    with pytest.raises(ValueError, match="neighbours must have shape"):
        clf.predict_proba(x, neighbours=nb[:, :3])
    with pytest.raises(ValueError, match="neighbours must be bank rows"):
        clf.predict_proba(x, neighbours=nb + 100)
    with pytest.raises(TypeError, match="neighbours"):
        clf.predict_proba(x, neighbours=nb.float())
    ccknn = NeighbourKernelClassifier(bank, k=2, sigma=1.0, rule="ccknn")
    with pytest.raises(ValueError, match="rule='nngk'"):
        ccknn.predict_proba(x, neighbours=nb)
    zero = CentreBank(bank.centres, bank.centre_labels, weights=torch.zeros(bank.num_centres))
    with pytest.raises(ValueError, match="weight 0"):
        NeighbourKernelClassifier(zero, k=2, sigma=1.0).predict_proba(x, neighbours=nb)


@pytest.mark.parametrize("fused", ["cpu", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("rule", ["nngk", "ccknn"])
def test_fused_distances_give_the_torch_forms_probabilities(monkeypatch, rule, fused):
    """The classifier's one-pass distances against its torch form: on CPU tensors the compiled
    library's; and the pass CUDA tensors take (kernels/relative_distances.py), run here
    through Triton's interpreter on CPU tensors in place of the library's."""
    from nnkloss.evaluation import classifier as clf_mod
    from nnkloss import cpu
    if fused == "cpu":
        if not cpu.available():
            pytest.skip("no C++ compiler: the torch form only")
        real = cpu.rel_sqdist
    else:
        real = nnkloss.ops.backends.kernels().rel_sqdist
    bank = make_bank(weights=True)
    x = torch.randn(30, 6, generator=torch.Generator().manual_seed(4)) * 2
    x[0] *= 1e3  # a far query
    clf = NeighbourKernelClassifier(bank, k=7, sigma=1.3, search_backend="torch", rule=rule,
                                    batch_size=16)
    calls = []

    def spy(*a):
        calls.append(a[2].shape)
        return real(*a)
    if fused == "cpu":  # the real routing: CPU tensors reach cpu.rel_sqdist
        monkeypatch.setattr(cpu, "rel_sqdist", spy)
    else:  # the kernel in the library's place, as CUDA tensors are routed
        monkeypatch.setattr(clf_mod, "_fused_rel_sqdist", spy)
    p = clf.predict_proba(x)
    assert calls and all(s[1] == 7 for s in calls)
    monkeypatch.setattr(clf_mod, "_fused_rel_sqdist", lambda *a: None)  # the torch form
    torch.testing.assert_close(p, clf.predict_proba(x), atol=1e-6, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("rule", ["nngk", "ccknn"])
def test_cuda_distances_come_from_the_triton_kernel(monkeypatch, rule):
    """On a GPU the classifier gathers no (rows, k, D) block: its distances are the Triton
    kernel's, and its probabilities those of the CPU."""
    kernels = nnkloss.ops.backends.kernels()
    bank = make_bank(weights=True)
    x = torch.randn(30, 6, generator=torch.Generator().manual_seed(4)) * 2
    want = NeighbourKernelClassifier(bank, k=7, sigma=1.3, search_backend="torch",
                                     rule=rule).predict_proba(x)
    real, calls = kernels.rel_sqdist, []
    monkeypatch.setattr(kernels, "rel_sqdist", lambda *a: calls.append(1) or real(*a))
    clf = NeighbourKernelClassifier(bank.to("cuda"), k=7, sigma=1.3, search_backend="torch",
                                    rule=rule)
    got = clf.predict_proba(x.cuda())
    assert calls
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", ["nngk", "ccknn"])
def test_a_negative_centre_label_is_refused_naming_centre_labels(rule):
    """Column c of the probabilities is class c, so a bank with a negative centre label cannot
    be classified with: refused, naming centre_labels. (The NNGK class sums raised torch's
    out-of-bounds error; CCKNN wrote class -1 into the last class's column, silently: the query
    on the label -1 centre came out class 0 with probability 1.)"""
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [20.0, 0.0]])
    bank = CentreBank(centres, torch.tensor([-1, 0, 1]))
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0, search_backend="torch", rule=rule)
    with pytest.raises(ValueError, match=r"^the bank's centre_labels must be >= 0 to classify "
                       r"with \(column c of the probabilities is class c\), got -1$"):
        clf.predict_proba(centres)
    bank.update_(centre_labels=torch.tensor([2, 0, 1]))
    assert clf.predict(centres).tolist() == [2, 0, 1]


@pytest.mark.parametrize("rule", ["nngk", "ccknn"])
def test_an_empty_query_batch_gives_an_empty_distribution(rule):
    """No query rows: (0, C) probabilities and (0,) predictions under both rules (CCKNN raised
    torch.cat's error on its empty list of reference centres, naming nothing)."""
    bank = make_bank()
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0, search_backend="torch", rule=rule)
    for dtype in (torch.float32, torch.float64):
        p = clf.predict_proba(torch.empty(0, bank.dim, dtype=dtype))
        assert p.shape == (0, bank.num_classes) and p.dtype == dtype
        assert clf.predict(torch.empty(0, bank.dim, dtype=dtype)).shape == (0,)
