"""kernels/neighbour_kernel.py on a real GPU when there is one (skipped without), against the
fp64 reference and the torch path; the same checks' logic on CPU tensors through the interpreter.
"""
import pytest
import torch

import nnkloss
from cases import SHAPES, compare, make_case


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_compile_and_cuda.py (now tests/test_compile.py) in issue 19.
def kernel_vs_reference(device, shape, bank_dtype):
    case = [t.to(device) if isinstance(t, torch.Tensor) else t
            for t in make_case(*shape, pad=0.1, seed=5)]
    compare(case, "triton", torch.float32, bank_dtype)


def triton_vs_torch_path(device, shape, bank_dtype):
    """Triton against the fp64 torch path on the same device: the loss and the gradients of
    the embeddings, weights, sigma and centres (the entry-terms kernel and the centre scatter
    on a GPU)."""
    emb, labels, centres, cl, nb, w = [t.to(device) if isinstance(t, torch.Tensor) else t
                                       for t in make_case(*shape, pad=0.1, seed=6)]
    cen = centres.to(bank_dtype)
    outs = {}
    for be, e, c in [("triton", emb.float(), cen), ("torch", emb.double(), cen.double())]:
        e = e.clone().requires_grad_(True)
        c = c.clone().requires_grad_(True)
        ww = w.clone().float().requires_grad_(True)
        s = torch.tensor(1.3, device=device, requires_grad=True)
        loss = nnkloss.neighbour_kernel_loss(e, labels, c, cl, nb, ww, s, backend=be)
        loss.backward()
        outs[be] = [loss.double(), e.grad.double(), ww.grad.double(), s.grad.double(),
                    c.grad.double()]
    for i, (a, b) in enumerate(zip(outs["triton"], outs["torch"], strict=True)):
        # the centre gradient is stored in the bank's dtype (8 bits of mantissa for bf16)
        rtol = 1e-2 if i == 4 and bank_dtype != torch.float32 else 1e-3
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.interpreter
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
def test_gpu_checks_run_on_cpu_interpreter(bank_dtype):
    """The CUDA tests' own logic, on CPU tensors through the interpreter (small shapes)."""
    kernel_vs_reference("cpu", (5, 25, 3, 13), bank_dtype)
    triton_vs_torch_path("cpu", (6, 80, 33, 17), bank_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES + [(16, 500, 512, 100), (9, 300, 2048, 37),
                                            (6, 200, 5000, 9)])
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(shape, bank_dtype):
    kernel_vs_reference("cuda", shape, bank_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(64, 5000, 512, 100), (33, 300, 2048, 37), (16, 200, 5000, 9),
                                   (256, 20000, 128, 256)])
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_vs_torch_path(shape, bank_dtype):
    triton_vs_torch_path("cuda", shape, bank_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("D, K", [(128, 100), (512, 32), (64, 1000)])
@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference_with_the_large_batch_tiles(D, K, bank_dtype):
    """Every other shape above is a small batch, which on a GPU takes the lengthened tiles
    (default_config given the SM count); a batch of 8 warps per SM takes the rule's own tiles
    (one warp a row, two rows a training tile), checked here against the reference too."""
    from nnkloss.ops.backends import kernels
    nk = kernels().neighbour_kernel
    sms = nk.sm_count(torch.device("cuda"))
    B = 8 * sms
    size = torch.tensor([], dtype=bank_dtype).element_size()
    assert (nk.default_config(K, D, elem_size=size, B=B, sms=sms)
            == nk.default_config(K, D, elem_size=size))
    assert (nk.default_config(K, D, elem_size=size, B=B // 8, sms=sms)
            != nk.default_config(K, D, elem_size=size))
    kernel_vs_reference("cuda", (B, 3000, D, K), bank_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("B, D, K", [(4096, 128, 100), (128, 64, 1000)])
@pytest.mark.parametrize("need_grad_x", [True, False])
def test_cuda_prefetched_list_entries_give_the_same_bits(B, D, K, need_grad_x):
    """FwdConfig.prefetch_index on the GPU's own builds (the rule's tiles at B 4096 and the
    small batch's lengthened ones): the same outputs bit for bit as without it."""
    import dataclasses

    from nnkloss.ops.backends import kernels
    k = kernels()
    emb, labels, centres, cl, nb, w = [t.to("cuda") for t in make_case(B, 3000, D, K, pad=0.1,
                                                                        seed=7)]
    args = (emb.float(), labels, centres.float(), cl, nb, w.float(),
            torch.tensor(1.3, device="cuda"))
    cfg = k.default_config(K, D, B=B, sms=k.neighbour_kernel.sm_count(emb.device),
                           grad_x=need_grad_x)
    outs = [k.neighbour_kernel_fwd(*args, config=dataclasses.replace(cfg, prefetch_index=p),
                                   need_grad_x=need_grad_x) for p in (False, True)]
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30))
    assert outs[0][0].gt(0).any()
