"""nnkloss/experiment/evaluate.py: extract_embeddings embeds with the BatchNorms folded and
leaves the model as it was. (Its other helpers are tested with the scripts that use them:
tests/test_train.py, tests/test_repro.py, tests/test_fashion_mnist.py.)"""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnkloss.experiment.datasets import IndexedTensorDataset
from nnkloss.experiment.evaluate import extract_embeddings

from cases import spy_batch_norms


def test_extract_embeddings_folds_batch_norm_and_restores_the_model(monkeypatch):
    torch.manual_seed(0)
    x, y = torch.randn(40, 1, 6, 6), torch.randint(0, 3, (40,))
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(144, 5))
    model.train()
    for _ in range(3):  # running statistics that are not the identity's
        model(x * 2 + 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        want = model(x)
    model.train()
    seen = spy_batch_norms(monkeypatch)
    emb, lab = extract_embeddings(model, DataLoader(IndexedTensorDataset(x, y), batch_size=16,
                                                    shuffle=True))
    assert seen == []  # the folded copy ran: no BatchNorm did
    monkeypatch.undo()
    torch.testing.assert_close(emb, want, rtol=1e-5, atol=1e-6)  # rows placed by idx
    assert torch.equal(lab, y)
    assert model.training and all(torch.equal(v, state[k])
                                  for k, v in model.state_dict().items())


def test_extract_embeddings_restores_the_mode_when_the_model_is_refused():
    model = nn.Linear(2, 2)
    model.train()
    with pytest.raises(ValueError, match="no batches"):
        extract_embeddings(model, [])
    assert model.training
