"""The README's training-loop example runs as written (on CPU, with tiny data)."""
# Cross-cutting suite (tests/test_layout.py CROSS_CUTTING): the README's examples as written.
import os
import re

import torch
from torch.utils.data import DataLoader

from nnkloss.experiment.datasets import IndexedTensorDataset

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_block(heading):
    text = open(README, encoding="utf-8").read()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_training_loop_example_runs():
    code = readme_block("### The loss in a training loop")
    code = code.replace('device = "cuda"', 'device = "cpu"')
    torch.manual_seed(0)
    n, d_in, d = 40, 5, 3
    x = torch.randn(n, d_in)
    y = torch.randint(0, 4, (n,))
    ds = IndexedTensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, 8), torch.nn.ReLU(), torch.nn.Linear(8, d))
    ns = dict(N=n, D=d, train_labels=y, model=model, epochs=2,
              eval_loader=DataLoader(ds, batch_size=16),
              train_loader=DataLoader(ds, batch_size=8, shuffle=True))
    code = code.replace("k=100", "k=10")
    with torch.no_grad():
        initial = model(x)  # the refresh runs before the first step
    exec(compile(code, "README.md", "exec"), ns)
    assert torch.isfinite(ns["loss"])
    bank = ns["bank"]
    assert bank.has_neighbours and bank.k == 10
    torch.testing.assert_close(bank.centres, initial)
    assert any(p.grad is not None for p in model.parameters())


def test_opening_example_runs():
    """The first example: a bank from centres and their centre_labels, a batch with its
    labels and bank rows."""
    code = readme_block("# nnkloss").replace("k=100", "k=10")
    g = torch.Generator().manual_seed(1)
    n, d = 60, 4
    centres = torch.randn(n, d, generator=g)
    centre_labels = torch.arange(n) % 3
    idx = torch.tensor([0, 5, 7, 31])
    emb = (centres[idx] + 0.1 * torch.randn(4, d, generator=g)).requires_grad_()
    ns = dict(centres=centres, centre_labels=centre_labels, emb=emb,
              labels=centre_labels[idx], idx=idx)
    exec(compile(code, "README.md", "exec"), ns)
    assert torch.equal(ns["bank"].centre_labels, centre_labels.int())
    assert ns["bank"].k == 10 and torch.isfinite(ns["loss"])
    ns["loss"].backward()
    assert emb.grad is not None and bool(emb.grad.abs().sum() > 0)


def test_functional_op_example_runs():
    code = readme_block("### The functional op")
    g = torch.Generator().manual_seed(2)
    centres = torch.randn(30, 4, generator=g)
    centre_labels = torch.arange(30) % 3
    neighbours = torch.randint(0, 30, (5, 6), generator=g)
    ns = dict(emb=torch.randn(5, 4, generator=g), labels=torch.tensor([0, 1, 2, 0, 1]),
              centres=centres, centre_labels=centre_labels, neighbours=neighbours)
    exec(compile("import nnkloss\n" + code, "README.md", "exec"), ns)
    assert ns["out"].shape == () and torch.isfinite(ns["out"])
