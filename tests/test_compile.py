"""torch.compile without graph breaks, and torch.library's opcheck of the registered op.

A cross-cutting suite (tests/test_layout.py lists it): the public API as torch.compile sees it,
the loss module inside a network and the functional op (nnkloss/losses, nnkloss/ops/
neighbour_kernel.py), forward-only included. These tests need the compiler stack and cannot
run under mutmut's trampolines (tests/mutation.sh deselects the fullgraph ones). The kernel's
checks on a real GPU, which shared this file until issue 19, are tests/test_kernels_cuda.py."""
import pytest
import torch

import nnkloss
from nnkloss import cpu
from cases import make_case, spy_need_grad_x


class Head(torch.nn.Module):
    def __init__(self, bank):
        super().__init__()
        self.net = torch.nn.Linear(5, 4)
        self.loss = nnkloss.NeighbourKernelLoss(bank, sigma=1.2, learn_sigma=True)

    def forward(self, x, labels, idx):
        return self.loss(self.net(x), labels, idx)


def _bank():
    g = torch.Generator().manual_seed(0)
    return nnkloss.CentreBank(torch.randn(20, 4, generator=g),
                              torch.randint(0, 3, (20,), generator=g),
                              neighbours=torch.randint(-1, 20, (20, 6), generator=g))


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_fullgraph_no_graph_break(compile_backend):
    torch._dynamo.reset()
    model = Head(_bank())
    x = torch.randn(8, 5)
    idx = torch.arange(8, dtype=torch.long)
    labels = model.loss.bank.centre_labels[idx]
    eager = model(x, labels, idx)
    eager.backward()
    g_eager = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    out = compiled(x, labels, idx)
    out.backward()
    g_comp = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(out, eager)
    for a, b in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(a, b)


def test_functional_op_compiles_fullgraph():
    torch._dynamo.reset()
    emb, labels, centres, cl, nb, w = make_case(6, 12, 4, 5, seed=1)
    emb.requires_grad_(True)

    def f(e):
        return nnkloss.neighbour_kernel_loss(e, labels, centres, cl, nb, w, sigma=0.8)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(emb)
    torch.testing.assert_close(out, f(emb))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("store_dist,need_grad_x", [(True, True), (False, True), (True, False),
                                                    (False, False)])
@pytest.mark.parametrize("mean", [True, False])
def test_opcheck(backend, store_dist, need_grad_x, mean):
    """torch.library's own consistency checks of the registered op (schema, fake, autograd),
    forward-only (need_grad_x False: grad_x (B, 0)) included, with and without the mean."""
    emb, labels, centres, cl, nb, w = make_case(4, 9, 3, 5, seed=2)
    args = (emb.float().requires_grad_(need_grad_x), labels,
            centres.float().requires_grad_(store_dist), cl, nb,
            w.float().requires_grad_(store_dist), torch.tensor(1.1, requires_grad=store_dist),
            backend, store_dist, need_grad_x, mean)
    torch.library.opcheck(torch.ops.nnkloss.nk_forward.default, args)
    out = torch.ops.nnkloss.nk_forward(*args)
    assert out[3].shape == ((4, 3) if need_grad_x else (4, 0))
    if mean:
        torch.testing.assert_close(out[6], out[0].sum() / out[5].sum().clamp_min(1))


def test_direct_forward_only_call_refuses_an_embedding_gradient():
    emb, labels, centres, cl, nb, w = make_case(4, 9, 3, 5, seed=2)
    e = emb.float().requires_grad_(True)
    out = torch.ops.nnkloss.nk_forward(e, labels, centres.float(), cl, nb, None,
                                       torch.tensor(1.0), "torch", False, False, False)
    with pytest.raises(RuntimeError, match="need_grad_x=False"):
        out[0].sum().backward()


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_forward_only_compiles_fullgraph(monkeypatch, compile_backend, backend):
    """Under no_grad the compiled module calls the forward-only op (need_grad_x False), with
    no graph break, and gives the eager loss."""
    seen = spy_need_grad_x(monkeypatch, backend)
    torch._dynamo.reset()
    emb, labels, centres, cl, nb, w = make_case(6, 12, 4, 5, seed=1)

    def f(e):
        return nnkloss.neighbour_kernel_loss(e, labels, centres, cl, nb, w, sigma=0.8,
                                             backend=backend)

    with torch.no_grad():
        eager = f(emb)
        out = torch.compile(f, fullgraph=True, backend=compile_backend)(emb)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert seen and not any(seen)


def test_functional_op_with_a_changing_float_sigma_does_not_recompile_per_value():
    """A Python float sigma that changes every call (a schedule) stays symbolic: torch.full
    had specialised the graph on its value, so aot_eager / inductor recompiled on every new
    sigma (and ran eagerly past the recompile limit)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    emb, labels, centres, cl, nb, w = make_case(6, 12, 4, 5, seed=1)
    emb, centres, w = emb.float(), centres.float(), w.float()

    def f(e, s):
        return nnkloss.neighbour_kernel_loss(e, labels, centres, cl, nb, w, sigma=s)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for s in (0.8, 0.9, 1.0, 1.1, 1.25):
        e, e_ref = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
        out, ref = compiled(e, s), f(e_ref, s)
        out.backward()
        ref.backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(e.grad, e_ref.grad)
    # the first call specialises, the second makes sigma dynamic; none after that
    assert counter.frame_count <= 2
