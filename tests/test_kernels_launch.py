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


def test_launch_helpers_are_plain_python_with_tritons_values():
    """pow2_ceil and cdiv give triton.next_power_of_2 / triton.cdiv's values, without the
    constexpr-function wrapper (3.6-4.2 us a call on the host, paid by every launch)."""
    import triton
    nk = nnkloss.ops.backends.kernels().neighbour_kernel
    for n in list(range(1, 5000)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert nk.pow2_ceil(n) == triton.next_power_of_2(n), n
    assert nk.pow2_ceil(0) == nk.pow2_ceil(-3) == 1
    for a in list(range(0, 300)) + [2**40 + 1]:
        for b in (1, 2, 3, 7, 64, 1000):
            assert nk.cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.interpreter
def test_no_launcher_calls_tritons_constexpr_functions_on_the_host(monkeypatch):
    """Every launcher sizes its tiles and grid with the plain helpers: with triton's
    next_power_of_2 and cdiv made to fail, each still runs (on CPU tensors, interpreted)."""
    import triton

    def refuse(*args, **kwargs):
        raise AssertionError("a launcher called triton's constexpr function on the host")
    k = nnkloss.ops.backends.kernels()
    emb, labels, centres, cl, nb, w = make_case(5, 30, 70, 9, seed=15, pad=0.2)
    emb, centres, w = emb.float(), centres.float(), w.float()
    monkeypatch.setattr(triton, "next_power_of_2", refuse)
    monkeypatch.setattr(triton, "cdiv", refuse)
    s = torch.tensor(1.2)
    loss, lse_all, lse_pos, grad_x, dist = k.neighbour_kernel_fwd(emb, labels, centres, cl, nb,
                                                                  w, s)
    k.centre_grad(emb, centres, nb, torch.randn(5, 9))
    k.scale_rows(grad_x, torch.ones(5), lse_pos, torch.float32)
    k.entry_grads(dist, labels, cl, nb, w, lse_all, lse_pos, torch.ones(5), s, True, True, True)
    k.gathered_rows_finite(centres, nb)
    k.rel_sqdist(emb, centres, nb.clamp_min(0), nb[:, 0].clamp_min(0), torch.float32)
    k.batch_lists(torch.zeros(30, 4, dtype=torch.int32), torch.arange(5), labels, cl, True)
