"""kernels/neighbour_kernel.py: the Triton launchers at other block shapes and configurations
(the two-phase wide-D path, production block sizes, every launch configuration a tuner may pick,
a bad one, the centre-gradient launcher), against the torch path (nnkloss/ops/reference.py)."""
import pytest
import torch

import nnkloss
from nnkloss.ops import reference as torch_path
from cases import make_case


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_loss_op.py (now tests/test_ops_neighbour_kernel.py) in issue 19.
@pytest.mark.interpreter
def test_kernel_two_phase_path_matches_single_pass():
    """Wide-D path (distances first, then chunked weighted sums) on a small D by lowering the
    register block limit."""
    kernels = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(5, 30, 70, 9, seed=15, pad=0.2)
    emb, centres = emb.float(), centres.float()
    s = torch.tensor(1.2)
    one = kernels.neighbour_kernel_fwd(emb, labels, centres, cl, nb, w.float(), s)
    two = kernels.neighbour_kernel_fwd(emb, labels, centres, cl, nb, w.float(), s, max_block_d=16)
    ref = torch_path.forward(emb, labels, centres, cl, nb, w.float(), s)
    for a, b, r in zip(one, two, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_kernel_centre_grad_matches_torch():
    kernels = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(6, 15, 37, 7, seed=16, pad=0.3)
    coef = torch.randn(6, 7, dtype=torch.float64)
    a = kernels.centre_grad(emb, centres, nb, coef)
    b = torch_path.centre_grad(emb, centres, nb, coef)
    torch.testing.assert_close(a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("B, N, D, K", [(4, 500, 512, 100), (3, 300, 2048, 37),
                                        (2, 200, 5000, 9), (3, 100, 4096, 8)])
def test_kernel_at_production_block_sizes(B, N, D, K):
    """The block shapes a GPU uses for wide D (single pass up to 4096, two-phase beyond),
    against the torch path, with a bf16 bank."""
    kernels = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(B, N, D, K, seed=17, pad=0.1)
    emb, cen, w = emb.float(), centres.to(torch.bfloat16), w.float()
    s = torch.tensor(float(D) ** 0.5)
    got = kernels.neighbour_kernel_fwd(emb, labels, cen, cl, nb, w, s)
    ref = torch_path.forward(emb, labels, cen, cl, nb, w, s)
    for name, a, r in zip(["loss", "lse_all", "lse_pos", "grad_x", "dist"], got, ref, strict=True):
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), fin), name
        torch.testing.assert_close(a[fin], r[fin], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_k, block_d, D", [(1, 128, 70), (4, 64, 70), (16, 128, 70),
                                                 (64, 16, 70), (2, 1, 9)])
def test_every_launch_config_computes_the_same(block_k, block_d, D):
    """Any configuration a tuner may pick is exact: single pass (block_d >= D) or two-phase.
    (One column a chunk runs at D 9: at D 70 its 70 chunks took ~50 s of the interpreter.)"""
    kernels = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(4, 40, D, 23, seed=18, pad=0.2)
    emb, centres, w = emb.float(), centres.float(), w.float()
    s = torch.tensor(1.7)
    cfg = kernels.FwdConfig(block_k, block_d, num_warps=2)
    got = kernels.neighbour_kernel_fwd(emb, labels, centres, cl, nb, w, s, config=cfg)
    ref = torch_path.forward(emb, labels, centres, cl, nb, w, s)
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_bad_launch_config():
    kernels = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(2, 5, 3, 2)
    with pytest.raises(ValueError, match="block_k"):
        kernels.neighbour_kernel_fwd(emb.float(), labels, centres.float(), cl, nb, None,
                                     torch.tensor(1.0), config=kernels.FwdConfig(3, 4))
