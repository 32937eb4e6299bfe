"""kernels/scale_rows.py: the backward's embedding gradient as a Triton kernel, against the
torch form of the row rule (Triton's interpreter on CPU tensors)."""
import pytest
import torch

import nnkloss

pytestmark = pytest.mark.interpreter


def _kernels():
    return nnkloss.ops.backends.kernels()


def _torch_form(grad_x, g, lse_pos):
    takes = g.to(grad_x.dtype) != 0
    if lse_pos is not None:
        takes = takes & (lse_pos != float("-inf"))
    return torch.where(takes[:, None], g.to(grad_x.dtype)[:, None] * grad_x, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,D", [(1, 1), (7, 13), (37, 300), (5, 2500)])
def test_scales_rows_and_applies_the_row_rule(dtype, B, D):
    # D 2500: three column blocks of 1024, the last ragged; B 37 at D 300: rows of a tile
    # beyond B masked.
    gen = torch.Generator().manual_seed(B * D)
    grad_x = torch.randn(B, D, generator=gen, dtype=dtype)
    g = torch.randn(B, generator=gen, dtype=dtype)
    lse_pos = torch.randn(B, generator=gen, dtype=dtype)
    if B > 2:
        g[1] = 0.0                      # takes no gradient ...
        grad_x[1, 0] = float("nan")     # ... and passes no NaN on
        lse_pos[2] = float("-inf")      # no same-class neighbour
        grad_x[2, -1] = float("inf")
        lse_pos[0] = float("nan")       # a non-finite row is counted: its NaN goes on
        grad_x[0, :] = float("nan")
    k = _kernels()
    for lp in (lse_pos, None):
        out = k.scale_rows(grad_x, g, lp)
        assert out.dtype == dtype and out.shape == (B, D)
        torch.testing.assert_close(out, _torch_form(grad_x, g, lp), rtol=0, atol=0,
                                   equal_nan=True)
    if B > 2:
        assert (out[1] == 0).all() and torch.isnan(out[0]).all()
        assert (k.scale_rows(grad_x, g, lse_pos)[2] == 0).all()


def test_expanded_scalar_gradient_strided_input_and_output_dtype():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 40, generator=gen)
    grad_x = wide[:, :33]                       # rows of stride 40
    g = torch.tensor(0.25).expand(9)            # stride 0, as autograd hands a mean's gradient
    lse_pos = torch.randn(12, generator=gen)[::4].clone()[:3].repeat(3)
    lse_pos[4] = float("-inf")
    k = _kernels()
    out = k.scale_rows(grad_x, g, lse_pos, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _torch_form(grad_x, g, lse_pos).to(torch.bfloat16))
    assert (out[4] == 0).all()
    assert k.scale_rows(grad_x[:0], g[:0], lse_pos[:0]).shape == (0, 33)
    assert k.scale_rows(torch.zeros(4, 0), torch.ones(4), None).shape == (4, 0)
