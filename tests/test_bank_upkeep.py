"""nnkloss/experiment/bank_upkeep.py: the Trainer's bank-maintenance state machine."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nnkloss import CentreBank, NeighbourKernelLoss, RefreshSchedule
from nnkloss.experiment.bank_upkeep import BankUpkeep, refresh_columns


class FakeRefresher:
    """Counts refreshes and list rebuilds (synchronous)."""

    def __init__(self):
        self.refreshes, self.rebuilds = [], []

    def refresh(self, sigma=None):
        self.refreshes.append(sigma)
        return {"sigma": sigma, "k": 3, "backend": "torch"}

    def rebuild_neighbours(self, sigma=None):
        self.rebuilds.append(sigma)
        return SimpleNamespace(overlap=0.5, positive_share=1.0, mean_kernel=0.25)


def setup(**options):
    bank = CentreBank(torch.zeros(6, 2), torch.tensor([0, 0, 0, 1, 1, 1]))
    loss = NeighbourKernelLoss(bank, sigma=2.0)
    ref = FakeRefresher()
    up = BankUpkeep(loss, nn.Linear(2, 2), ref, options.pop("schedule", None), **options)
    return up, ref, bank


def test_initial_bank_warm_start_lists_and_fresh_centres():
    up, ref, bank = setup(schedule=RefreshSchedule(every_epochs=1), fresh_centres=0.0,
                          neighbours_every_steps=2, warm_start_steps=3)
    assert up.needs_initial_bank
    up.before_fit(more_epochs=True)
    assert ref.refreshes == [2.0] and up.bank_ready and not up.needs_initial_bank
    assert up.take_pending()["start_refresh_sigma"] == 2.0 and up.take_pending() == {}
    up.start_epoch()
    for step in range(1, 5):
        idx = torch.tensor([step % 6])
        up.after_step(step, idx, torch.full((1, 2), float(step)))
        assert bank.centres[step % 6].tolist() == [float(step)] * 2  # momentum 0: replaced
    assert ref.refreshes == [2.0, 2.0]  # the warm start after step 3
    assert ref.rebuilds == [2.0, 2.0]  # steps 2 and 4
    row = up.epoch_columns()
    assert row["neighbours_rebuilds"] == 2 and row["neighbours_overlap"] == 0.5
    assert row["refresh_k"] == 3 and "refresh_search_backend" not in row  # numbers only
    assert up.end_epoch(last=False)["end_refresh_sigma"] == 2.0 and not up.refresh_due
    assert up.end_epoch(last=True) == {} and up.refresh_due  # skipped, due at the next fit
    up.before_fit(more_epochs=True)
    assert len(ref.refreshes) == 4 and not up.refresh_due


def test_no_refresher_is_a_no_op_and_options_are_checked():
    up = BankUpkeep(nn.Linear(2, 2), nn.Linear(2, 2), None, None)
    up.before_fit(True)
    up.start_epoch()
    up.after_step(1, torch.tensor([0]), torch.zeros(1, 2))
    assert not up.needs_initial_bank and up.epoch_columns() == {} and up.end_epoch(True) == {}
    with pytest.raises(ValueError, match="fresh_centres"):
        setup(fresh_centres=1.5)
    with pytest.raises(TypeError, match="schedule"):
        setup(schedule="every epoch")
    assert refresh_columns(None) == {} and refresh_columns({"x": torch.tensor(1.0)}) == {
        "refresh_x": 1.0}
