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
