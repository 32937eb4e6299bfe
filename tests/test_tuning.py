"""choose_sigma: the kernel width with the lowest validation loss, nothing trained."""
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nnkloss
from nnkloss import CentreBank, NeighbourKernelLoss, Refresher
from nnkloss.experiment import choose_sigma
from nnkloss.experiment.datasets import IndexedTensorDataset
from nnkloss.experiment.models import SoftmaxHead

from cases import spy_batch_norms

CANDIDATES = [0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0]


def setup(seed=0, n_per=30, classes=4, spread=1.5, k=10):
    """Overlapping classes, a model with dropout (must be off while embedding), and a bank of
    the validation rows built by a Refresher from the same (untrained) model."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, 5, generator=g) * spread
    y = torch.arange(classes).repeat_interleave(n_per)
    x = means[y] + torch.randn(len(y), 5, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    ds = IndexedTensorDataset(x, y)
    bank = CentreBank(torch.zeros(len(ds), 4), y.clone())
    crit = NeighbourKernelLoss(bank, sigma=0.7, learn_sigma=True)
    Refresher(bank, model, DataLoader(ds, batch_size=64), k=k, search_backend="torch").refresh()
    return model, crit, DataLoader(ds, batch_size=16, shuffle=True), x, y


def reference_mean(model, bank, x, y, sigma):
    model.eval()
    with torch.no_grad():
        emb = model(x)
    model.train()
    ref = NeighbourKernelLoss(bank, sigma=sigma, reduction="none")
    ref(emb, y, torch.arange(len(y)))
    st = ref.last_stats
    return float(st.per_row[st.counted].double().sum() / st.counted.sum())


def test_choose_sigma_is_the_argmin_of_the_mean_validation_loss():
    model, crit, loader, x, y = setup()
    model.train()
    best, losses = choose_sigma(model, crit, loader, CANDIDATES)
    assert list(losses) == CANDIDATES
    for s in CANDIDATES:  # a mean over rows, with the eval-mode embeddings
        assert losses[s] == pytest.approx(reference_mean(model, crit.bank, x, y, s), rel=1e-5)
    assert best == min(CANDIDATES, key=losses.get)
    # Overlapping classes: too narrow and too wide both cost (the minimum is inside).
    assert losses[CANDIDATES[0]] > losses[best] < losses[CANDIDATES[-1]]
    assert CANDIDATES[0] < best < CANDIDATES[-1]
    # Nothing changed: sigma, the modes, the bank.
    assert crit.kernel_sigma() == pytest.approx(0.7) and crit.log_sigma.requires_grad
    assert model.training and model[2].training


def test_choose_sigma_restores_sigma_on_error():
    model, crit, loader, x, y = setup()

    class Broken:
        def __iter__(self):
            yield from loader
            raise OSError("disk on fire")

    with pytest.raises(OSError):
        choose_sigma(model, crit, Broken(), CANDIDATES)
    assert crit.kernel_sigma() == pytest.approx(0.7)


def test_choose_sigma_never_picks_a_non_finite_loss():
    model, crit, loader, x, y = setup()
    with torch.no_grad():
        model[3].bias.fill_(float("nan"))  # every embedding NaN: the loss shows it
    with pytest.raises(ValueError, match="finite"):
        choose_sigma(model, crit, loader, CANDIDATES)


def test_choose_sigma_bad_arguments():
    model, crit, loader, x, y = setup()
    for cands, exc in (([], ValueError), ([1.0, -1.0], ValueError), ([math.inf], ValueError),
                       ("1.0", TypeError), ([True], TypeError), (3.0, TypeError)):
        with pytest.raises(exc, match="candidates"):
            choose_sigma(model, crit, loader, cands)
    with pytest.raises(TypeError, match="criterion"):
        choose_sigma(model, SoftmaxHead(4, 4), loader, CANDIDATES)
    with pytest.raises(ValueError, match="no batches"):
        choose_sigma(model, crit, [], CANDIDATES)
    with pytest.raises(ValueError, match="triples"):
        choose_sigma(model, crit, [(x, y)], CANDIDATES)


def test_choose_sigma_without_a_same_class_neighbour_is_an_error():
    model, crit, loader, x, y = setup()
    bank = crit.bank
    bank.update_(centre_labels=torch.arange(len(y)))  # every row its own class
    with pytest.raises(ValueError, match="same-class neighbour"):
        choose_sigma(model, crit, DataLoader(IndexedTensorDataset(x, torch.arange(len(y))),
                                             batch_size=32), CANDIDATES)


def test_exported():
    assert nnkloss.experiment.choose_sigma is choose_sigma
    assert "choose_sigma" in nnkloss.experiment.__all__


def test_choose_sigma_embeds_with_batch_norm_folded(monkeypatch):
    """The validation embeddings come from the folded copy (nnkloss/inference.py): the same
    losses as the model's eval mode, no BatchNorm run, the model's statistics unchanged."""
    model, crit, loader, x, y = setup()
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    for _ in range(3):  # running statistics that are not the identity's
        model(x * 2 + 1)
    Refresher(crit.bank, model, DataLoader(IndexedTensorDataset(x, y), batch_size=64), k=10,
              search_backend="torch").refresh()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = spy_batch_norms(monkeypatch)
    _, losses = choose_sigma(model, crit, loader, [0.3, 1.0])
    assert seen == []
    monkeypatch.undo()
    for s in (0.3, 1.0):
        assert losses[s] == pytest.approx(reference_mean(model, crit.bank, x, y, s), rel=1e-5)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
