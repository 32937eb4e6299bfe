"""Refresher promises without a test that could fail (issue 14): "the bank changed size during
the refresh" (a background refresh computed for N rows is refused by a bank that now has
more), and a refresh that fails leaves the bank untouched."""
import threading
import time

import pytest
import torch
from torch import nn

from nnkloss import CentreBank, Refresher


class GatedLoader:
    """Yields (x, y, idx) batches; each iteration first signals ``started`` and then waits
    for ``go``, so a test can act while a background refresh is surely under way."""

    def __init__(self, x, y, batch=8):
        self.x, self.y, self.batch = x, y, batch
        self.started, self.go = threading.Event(), threading.Event()

    def __iter__(self):
        self.started.set()
        assert self.go.wait(30), "test never released the loader"
        for lo in range(0, len(self.y), self.batch):
            idx = torch.arange(lo, min(lo + self.batch, len(self.y)))
            yield self.x[idx], self.y[idx], idx

    def __len__(self):
        return -(-len(self.y) // self.batch)


def setup(n=24, d=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    y = torch.arange(n) % 3
    torch.manual_seed(0)
    model = nn.Linear(5, d)
    bank = CentreBank(torch.randn(n, d, generator=g), y.clone(),
                      neighbours=torch.randint(0, n, (n, 3), generator=g))
    loader = GatedLoader(x, y)
    return bank, model, loader


@pytest.mark.parametrize("finish", ["wait", "poll"])
def test_bank_grown_during_async_refresh_is_refused(finish):
    bank, model, loader = setup()
    refresher = Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                          async_mode=True)
    refresher.refresh_async()
    assert loader.started.wait(30)  # the worker sized its new bank at 24 rows
    bank.add(torch.zeros(2, 4), torch.tensor([0, 1]))
    grown = {k: v.clone() for k, v in bank.state_dict().items()}
    loader.go.set()
    with pytest.raises(RuntimeError, match="changed size during the refresh"):
        if finish == "wait":
            refresher.wait()
        else:
            deadline = time.monotonic() + 30
            while refresher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
    assert not refresher.in_flight
    for k, v in bank.state_dict().items():  # the grown bank is kept as it was
        assert torch.equal(v, grown[k]), k
    assert bank.num_centres == 26


def test_async_refresh_of_an_unchanged_bank_is_swapped_in():
    bank, model, loader = setup()
    refresher = Refresher(bank, model, loader, k=4, search_backend="torch", progress=False,
                          async_mode=True)
    refresher.refresh_async()
    loader.go.set()
    stats = refresher.wait()
    assert stats is not None and stats.asynchronous and stats.num_rows == 24
    with torch.no_grad():
        want = model(loader.x)
    torch.testing.assert_close(bank.centres, want)
    assert bank.k == 4 and not (bank.neighbours == torch.arange(24)[:, None]).any()
