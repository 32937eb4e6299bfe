"""kernels/counted_mean.py: the losses' mean over their counted rows as one Triton launch,
against the torch form of reduce_rows (Triton's interpreter on CPU tensors; the same checks on a
GPU). The checks take the launcher as an argument:
tests/test_cpu_op.py runs them on the CPU library's counted_mean, the same contract."""
import pytest
import torch

import nnkloss


def _kernels():
    return nnkloss.ops.backends.kernels()


def _torch_form(per_row, counted):
    return per_row.sum() / torch.count_nonzero(counted).clamp_min(1)


def _rows(B, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    counted = torch.rand(B, generator=gen) < 0.7
    per_row = torch.where(counted, torch.rand(B, generator=gen, dtype=dtype) * 5, 0.0)
    return per_row.to(device), counted.to(device)


def mean_checks(counted_mean, device, top):
    """``counted_mean`` (the Triton launch or the CPU library's call: the same contract)
    against the torch form; ``top``: the most rows it takes (None: any number)."""
    for dtype in (torch.float32, torch.float64):
        # one row, a ragged step, exactly one step, several steps, the most rows taken
        for B in (1, 7, 2048, 2049, 5000, top or 100_003):
            per_row, counted = _rows(B, dtype, device, B)
            mean, divisor = counted_mean(per_row, counted)
            assert mean.shape == () and mean.dtype == dtype and divisor.dtype == dtype
            assert divisor.item() == max(1, int(counted.sum()))
            # the sum in another order than torch's: to its rounding, not bit for bit
            torch.testing.assert_close(mean, _torch_form(per_row, counted),
                                       rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0)
    # No counted row: the mean is 0 and the divisor 1; no row at all, the same.
    for B in (0, 9):
        mean, divisor = counted_mean(torch.zeros(B, device=device),
                                     torch.zeros(B, dtype=torch.bool, device=device))
        assert mean.item() == 0.0 and divisor.item() == 1.0
    # A NaN row is counted and reaches the mean; so does an inf.
    per_row, counted = _rows(300, torch.float32, device, 1)
    for bad in (float("nan"), float("inf")):
        rows = per_row.clone()
        rows[123], counted[123] = bad, True
        mean = counted_mean(rows, counted)[0]
        assert torch.equal(mean.isnan(), _torch_form(rows, counted).isnan())
        assert not torch.isfinite(mean)
    # The same bits on every call (a fixed order of summation).
    per_row, counted = _rows(3001, torch.float32, device, 4)
    assert torch.equal(counted_mean(per_row, counted)[0], counted_mean(per_row, counted)[0])
    if top is None:
        return
    # Strided rows (a column of a (B, 2) tensor) are read as they are laid out.
    per_row, counted = _rows(501, torch.float64, device, 2)
    wide = torch.stack([per_row, -per_row], 1)
    torch.testing.assert_close(counted_mean(wide[:, 0], counted)[0],
                               _torch_form(per_row, counted), rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match=f"per_row has {top + 1} rows"):
        counted_mean(torch.zeros(top + 1, device=device),
                     torch.zeros(top + 1, dtype=torch.bool, device=device))


class _MeanFromLaunch(torch.autograd.Function):
    """A launcher's mean with the op's backward of it: every row's gradient g / divisor, from
    the divisor the launch wrote (nnkloss/ops/neighbour_kernel.py folds that division into its
    embedding gradient)."""

    @staticmethod
    def forward(ctx, per_row, counted, counted_mean):
        mean, divisor = counted_mean(per_row, counted)
        ctx.save_for_backward(divisor)
        ctx.rows = per_row.shape[0]
        return mean

    @staticmethod
    def backward(ctx, g):
        divisor, = ctx.saved_tensors
        return (g / divisor).expand(ctx.rows), None, None


def mean_gradient_checks(counted_mean, device):
    """The divisor of the one-call mean gives every row's gradient g / max(count, 1), bit for
    bit the torch form's (uncounted rows too: the op's backward zeroes them itself)."""
    for B in (1, 37, 3000):
        per_row, counted = _rows(B, torch.float32, device, B + 1)
        got_x = per_row.clone().requires_grad_(True)
        want_x = per_row.clone().requires_grad_(True)
        got = _MeanFromLaunch.apply(got_x, counted, counted_mean)
        want = _torch_form(want_x, counted)
        (got * 3.0).backward()
        (want * 3.0).backward()
        assert torch.equal(got_x.grad, want_x.grad)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # no counted row: the divisor is 1, as clamp_min(1) makes it
    x = torch.zeros(4, device=device, requires_grad=True)
    _MeanFromLaunch.apply(x, torch.zeros(4, dtype=torch.bool, device=device),
                          counted_mean).backward()
    assert torch.equal(x.grad, torch.ones(4, device=device))
    per_row, counted = _rows(11, torch.float64, device, 5)
    assert torch.autograd.gradcheck(lambda r: _MeanFromLaunch.apply(r, counted, counted_mean),
                                    (per_row.requires_grad_(True),))


@pytest.mark.interpreter
def test_counted_mean_matches_the_torch_form():
    k = _kernels()
    mean_checks(k.counted_mean, "cpu", k.COUNTED_MEAN_MAX_ROWS)


@pytest.mark.interpreter
def test_counted_mean_gradient_is_the_torch_forms():
    mean_gradient_checks(_kernels().counted_mean, "cpu")


@pytest.mark.cuda
def test_counted_mean_on_cuda():
    k = _kernels()
    mean_checks(k.counted_mean, "cuda", k.COUNTED_MEAN_MAX_ROWS)
    mean_gradient_checks(k.counted_mean, "cuda")
