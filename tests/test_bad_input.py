"""A bad-input table for every public entry point (issue 10): each case raises an error that
names the argument at fault, or returns the documented result."""
# Cross-cutting suite (tests/test_layout.py CROSS_CUTTING): one table over every public entry
# point, kept whole on purpose; each module's own error tests live in its test file.

import pytest
import torch
from torch import nn

import nnkloss
from nnkloss.checksum import load_checked, save_checked


def setup():
    torch.manual_seed(0)
    c = torch.randn(10, 3)
    cl = torch.arange(10) % 2
    bank = nnkloss.CentreBank(c, cl)
    bank.rebuild_neighbours(3)
    emb, lab, idx = torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 2, 3])
    return bank, emb, lab, idx


def loss_cases():
    bank, emb, lab, idx = setup()
    lf = nnkloss.NeighbourKernelLoss(bank)
    cc = nnkloss.ClassConditionalLoss(bank, k=2, sigma=1.0)
    return [
        ("module emb list", lambda: lf([[0.0] * 3] * 4, lab, idx), TypeError, "emb must be a torch.Tensor"),
        ("module labels list", lambda: lf(emb, [0, 1, 0, 1], idx), TypeError, "labels must be a torch.Tensor"),
        ("module idx list", lambda: lf(emb, lab, [0, 1, 2, 3]), TypeError, "idx must be a torch.Tensor"),
        ("module idx length", lambda: lf(emb, lab, idx[:3]), ValueError, "idx has length 3"),
        ("module labels length", lambda: lf(emb, lab[:3], idx), ValueError, "labels has length 3"),
        ("module idx range", lambda: lf(emb, lab, torch.tensor([0, 1, 2, 10])), IndexError, "idx holds 10"),
        ("module idx float", lambda: lf(emb, lab, idx.float()), TypeError, "idx must have an integer"),
        ("module emb dim", lambda: lf(torch.randn(4, 5), lab, idx), ValueError, "emb has dimension 5"),
        ("module labels 2-D", lambda: lf(emb, lab[:, None], idx), ValueError, "labels must be 1-D"),
        ("module sigma", lambda: nnkloss.NeighbourKernelLoss(bank, sigma=0), ValueError, "sigma"),
        ("module bank", lambda: nnkloss.NeighbourKernelLoss("bank"), TypeError, "bank must be a CentreBank"),
        ("module reduction", lambda: nnkloss.NeighbourKernelLoss(bank, reduction="avg"), ValueError, "reduction"),
        ("ccml labels list", lambda: cc(emb, [0, 1, 0, 1], idx), TypeError, "labels must be a torch.Tensor"),
        ("ccml idx length", lambda: cc(emb, lab, idx[:3]), ValueError, "idx has length 3"),
    ]


def other_cases(tmp_path):
    bank, emb, lab, idx = setup()
    clf = nnkloss.NeighbourKernelClassifier(bank, k=3, sigma=1.0)
    model = nn.Linear(3, 3)
    m = nnkloss.evaluation.metrics
    nan = torch.full((4, 3), float("nan"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    return [
        ("classifier emb list", lambda: clf.predict([[0.0] * 3]), TypeError, "emb must be a torch.Tensor"),
        ("classifier emb 1-D", lambda: clf.predict(torch.randn(3)), ValueError, "emb must be 2-D"),
        ("classifier emb dim", lambda: clf.predict(torch.randn(2, 4)), ValueError, "emb has dimension 4"),
        ("classifier emb NaN", lambda: clf.predict(nan), ValueError, "emb contains NaN"),
        ("classifier k", lambda: nnkloss.NeighbourKernelClassifier(bank, k=0, sigma=1.0), ValueError, "k must be"),
        ("classifier sigma", lambda: nnkloss.NeighbourKernelClassifier(bank, k=3, sigma=-1.0), ValueError, "sigma"),
        ("recall ks", lambda: m.recall_at_k(emb, lab, (8,)), ValueError, "ks"),
        ("recall labels list", lambda: m.recall_at_k(emb, [0, 1, 0, 1], (1,)), TypeError, "labels must be"),
        ("recall labels length", lambda: m.recall_at_k(emb, lab[:3], (1,)), ValueError, "labels has length 3"),
        ("recall emb NaN", lambda: m.recall_at_k(nan, lab, (1,)), ValueError, "NaN"),
        ("map labels length", lambda: m.map_at_r(emb, lab[:3]), ValueError, "labels has length 3"),
        ("nmi labels length", lambda: m.nmi(emb, lab[:3]), ValueError, "labels has length 3"),
        ("nmi emb NaN", lambda: m.nmi(nan, lab), ValueError, "emb contains NaN"),
        ("accuracy shapes", lambda: m.accuracy(torch.tensor([0, 1]), torch.tensor([0, 1, 1])), ValueError, "pred has shape"),
        ("accuracy list", lambda: m.accuracy([0, 1], [0, 1]), TypeError, "pred must be"),
        ("refresher k", lambda: nnkloss.Refresher(bank, model, [], k=20), ValueError, "k=20"),
        ("refresher loader", lambda: nnkloss.Refresher(bank, model, None, k=2), TypeError, "loader must be"),
        ("refresher model", lambda: nnkloss.Refresher(bank, "net", [], k=2), TypeError, "model must be"),
        ("refresher batch", lambda: nnkloss.Refresher(bank, model, [(torch.randn(5, 3), lab)], k=2,
                                                      progress=False).refresh(), ValueError, "loader must yield"),
        ("save bank", lambda: nnkloss.save_bank("x", tmp_path / "a.pt"), TypeError, "bank must be a CentreBank"),
        ("save directory", lambda: nnkloss.save_bank(bank, tmp_path / "no" / "a.pt"), FileNotFoundError, "path"),
        ("save step", lambda: nnkloss.save_bank(bank, tmp_path / "a.pt", step=-1), ValueError, "step"),
        ("save extra", lambda: nnkloss.save_bank(bank, tmp_path / "a.pt", extra={"f": print}), TypeError, "extra"),
        ("load missing", lambda: nnkloss.load_bank(tmp_path / "missing.pt"), FileNotFoundError, "path"),
        ("load junk", lambda: nnkloss.load_bank(junk), ValueError, "path .* not a readable"),
        ("bank labels list", lambda: nnkloss.CentreBank(torch.randn(3, 2), [0, 1, 0]), TypeError, "centre_labels must be"),
        ("bank centres NaN", lambda: nnkloss.CentreBank(torch.full((3, 2), float("nan")), torch.zeros(3, dtype=torch.long)), ValueError, "centres contain NaN"),
        ("knn k", lambda: nnkloss.knn(emb, emb, 0), ValueError, "k must be"),
        ("knn queries list", lambda: nnkloss.knn([[1.0, 2.0, 3.0]], emb, 1), TypeError, "queries must be"),
    ]


@pytest.mark.parametrize("case", range(len(loss_cases())))
def test_losses_name_the_argument(case):
    name, call, exc, match = loss_cases()[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("case", range(29))
def test_entry_points_name_the_argument(case, tmp_path):
    cases = other_cases(tmp_path)
    assert len(cases) == 29
    name, call, exc, match = cases[case]
    with pytest.raises(exc, match=match):
        call()


def test_load_bank_refuses_nonfinite_log_weights(tmp_path):
    bank, *_ = setup()
    path = tmp_path / "bank.pt"
    for bad, learned in [(float("nan"), False), (float("inf"), False), (-float("inf"), True)]:
        nnkloss.save_bank(bank, path)
        state = load_checked(path)
        state["log_weights"][3] = bad
        state["learn_weights"] = learned
        save_checked(state, path)
        with pytest.raises(ValueError, match="log_weights"):
            nnkloss.load_bank(path)
    # A zero weight (-inf) of a fixed-weight bank is legal, as in CentreBank.update_.
    state["learn_weights"] = False
    save_checked(state, path)
    loaded, _, _ = nnkloss.load_bank(path)
    assert float(loaded.weights[3]) == 0.0


def test_load_state_dict_refuses_nonfinite_log_weights():
    bank, *_ = setup()
    loss_fn = nnkloss.NeighbourKernelLoss(bank)
    state = loss_fn.state_dict()
    state["bank.log_weights"] = state["bank.log_weights"].clone()
    state["bank.log_weights"][0] = float("nan")
    with pytest.raises(ValueError, match="log_weights"):
        loss_fn.load_state_dict(state)


def _bank20():
    g = torch.Generator().manual_seed(4)
    bank = nnkloss.CentreBank(torch.randn(20, 3, generator=g), torch.arange(20) % 3)
    bank.rebuild_neighbours(4, search_backend="torch")
    return bank


def _bad_bank_states():
    """(what, field, change to a state of a 20-row bank) of issue 18, finding 4."""
    def nb_at(v):
        return lambda s: s["neighbours"].__setitem__((2, 1), v)

    def centre_at(v):
        return lambda s: s["centres"].__setitem__((5, 0), v)
    return [
        ("index 99 with N = 20", "neighbours", nb_at(99), IndexError, "index 99"),
        ("index -5", "neighbours", nb_at(-5), IndexError, "index -5"),
        ("NaN centre", "centres", centre_at(float("nan")), ValueError, "NaN or inf"),
        ("inf centre", "centres", centre_at(float("inf")), ValueError, "NaN or inf"),
        ("25 labels for 20 centres", "centre_labels",
         lambda s: s.__setitem__("centre_labels", torch.arange(25, dtype=torch.int32) % 3),
         ValueError, "centre_labels has length 25"),
        ("lists for 10 of 20 rows", "neighbours",
         lambda s: s.__setitem__("neighbours", s["neighbours"][:10].clone()),
         ValueError, "one row per centre"),
        ("float labels", "centre_labels",
         lambda s: s.__setitem__("centre_labels", s["centre_labels"].float()),
         TypeError, "integer"),
        ("1-D centres", "centres", lambda s: s.__setitem__("centres", s["centres"][:, 0].clone()),
         ValueError, "2-D"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_load_state_dict_validates_the_whole_bank(case):
    """CentreBank.load_state_dict (directly, or through a loss) refuses what update_ refuses,
    naming the field, and leaves the bank unchanged."""
    what, field, change, exc, match = _bad_bank_states()[case]
    bank = _bank20()
    before = {k: v.clone() for k, v in bank.state_dict().items()}
    state = {k: v.clone() for k, v in bank.state_dict().items()}
    change(state)
    with pytest.raises(exc, match=match) as info:
        bank.load_state_dict(state)
    assert str(info.value).startswith(field), str(info.value)
    for k, v in bank.state_dict().items():
        assert torch.equal(v, before[k]), (what, k)
    loss_fn = nnkloss.NeighbourKernelLoss(_bank20())
    prefixed = {f"bank.{k}": v for k, v in state.items()}
    prefixed["log_sigma"] = loss_fn.log_sigma.detach().clone()
    with pytest.raises(exc, match=f"bank.{field}"):
        loss_fn.load_state_dict(prefixed)


@pytest.mark.parametrize("case", range(8))
def test_load_bank_validates_the_whole_bank(case, tmp_path):
    what, field, change, exc, match = _bad_bank_states()[case]
    path = tmp_path / "bank.pt"
    nnkloss.save_bank(_bank20(), path)
    state = load_checked(path)
    change(state)
    save_checked(state, path)                   # a well-formed file holding a bad bank
    with pytest.raises(exc, match=f"checkpoint {field}"):
        nnkloss.load_bank(path)
