"""kernels/gathered_finite.py: the value check of the gathered centres as a Triton kernel,
against torch's elementwise test (Triton's interpreter on CPU tensors)."""
import pytest
import torch

import nnkloss

pytestmark = pytest.mark.interpreter

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _kernels():
    return nnkloss.ops.backends.kernels()


def _torch_form(centres, neighbours):
    nb = neighbours.reshape(-1).long()
    listed = nb[nb >= 0]
    return bool(torch.isfinite(centres[listed]).all())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("D", [1, 13, 300])
def test_finds_a_nonfinite_value_only_in_a_listed_row(dtype, D):
    # 300 columns are two chunks of 256, the second ragged (80 entries: ten programs of 8);
    # 700 entries at D 13 are six programs of 128.
    g = torch.Generator().manual_seed(D)
    centres = torch.randn(60, D, generator=g).to(dtype)
    rows = 35 if D < 256 else 4
    nb = torch.randint(0, 50, (rows, 20), generator=g)  # rows 50-59 never listed
    nb[torch.rand(rows, 20, generator=g) < 0.2] = -1
    k = _kernels()
    ok = k.gathered_rows_finite(centres, nb)
    assert ok.dtype == torch.bool and ok.dim() == 0 and bool(ok)
    listed = int(nb[-1][nb[-1] >= 0][-1])  # listed by the last program's entries
    for value, col in ((float("nan"), D - 1), (float("inf"), 0), (-float("inf"), D // 2)):
        bad = centres.clone()
        bad[listed, col] = value
        assert not bool(k.gathered_rows_finite(bad, nb)) and not _torch_form(bad, nb)
        unlisted = centres.clone()
        unlisted[55, col] = value
        assert bool(k.gathered_rows_finite(unlisted, nb)) and _torch_form(unlisted, nb)
        padded = bad.clone()
        hidden = nb.masked_fill(nb == listed, -1)  # the bad row only behind padding
        assert bool(k.gathered_rows_finite(padded, hidden)) == _torch_form(padded, hidden)


def test_large_doubles_are_finite_and_edges():
    k = _kernels()
    huge = torch.full((3, 4), 1e300, dtype=torch.float64)  # inf once rounded to fp32
    assert bool(k.gathered_rows_finite(huge, torch.tensor([[0, 2]])))
    c = torch.randn(5, 8)
    assert bool(k.gathered_rows_finite(c, torch.zeros(3, 0, dtype=torch.long)))
    assert bool(k.gathered_rows_finite(c, torch.full((2, 3), -1)))
    assert bool(k.gathered_rows_finite(c[:0], torch.zeros(2, 2, dtype=torch.long)))
    c[0, 3] = float("nan")
    # int32 lists, strided bank rows (a view of a wider bank), a strided list
    wide = torch.randn(5, 20)
    wide[2, 5] = float("nan")
    nb = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    assert not bool(k.gathered_rows_finite(wide[:, 3:11], nb))
    assert bool(k.gathered_rows_finite(wide[:, 6:14], nb))
    assert not bool(k.gathered_rows_finite(wide[:, 3:11], torch.tensor([[2, 0, 1, 0]])[:, ::2]))
    # an index outside the bank (the check refuses it on the host, naming it) reads nothing
    assert bool(k.gathered_rows_finite(c, torch.tensor([[7], [-3]])))
    assert not bool(k.gathered_rows_finite(c, torch.tensor([[7], [0]])))


def test_a_list_that_flattens_to_a_strided_view_is_read_as_listed():
    # table[:, :1] (the nearest entry only) flattens to a view of stride 3, not a copy: read at
    # unit stride it listed rows 0, 1, 2 instead of 0, 5, 6, and the NaN of row 5 went unseen.
    k = _kernels()
    centres = torch.randn(8, 4)
    centres[5, 2] = float("nan")
    table = torch.tensor([[0, 1, 2], [5, 3, 4], [6, 7, 1]])
    assert not bool(k.gathered_rows_finite(centres, table[:, :1]))
    assert not _torch_form(centres, table[:, :1])
    assert bool(k.gathered_rows_finite(centres, table[:, 1:2]))  # rows 1, 3, 7: all finite
    assert _torch_form(centres, table[:, 1:2])


@pytest.mark.parametrize("D", [1, 64, 300, 1000])
def test_config_tiles_hold_at_most_the_tile(D):
    from nnkloss.kernels.gathered_finite import GATHERED_FINITE_TILE, gathered_finite_config
    be, bd = gathered_finite_config(D)
    assert be & (be - 1) == 0 and bd & (bd - 1) == 0 and bd <= 256
    assert be * bd == GATHERED_FINITE_TILE
