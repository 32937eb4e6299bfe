"""The device launches of one training step of the module (issue: the GPU step is bound by
the host, each launch costs host time): counted on the Triton route, the same for CUDA tensors
as for CPU tensors under Triton's interpreter, with the aten ops around the kernels."""
import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import nnkloss

# aten ops that launch nothing on a device: allocation, views, metadata, no-op casts.
NO_LAUNCH = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view",
             "aten::_unsafe_view", "aten::expand", "aten::detach", "aten::as_strided",
             "aten::alias", "aten::reshape", "aten::select", "aten::slice", "aten::unsqueeze",
             "aten::squeeze", "aten::contiguous", "aten::to", "aten::lift_fresh",
             "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::view_as",
             "aten::_reshape_alias", "aten::t", "aten::numpy_T", "detach"}


@contextlib.contextmanager
def count_launches():
    """Yields ``(kernels, ops)``, filled on exit: the Triton kernels launched (by name) and the
    aten ops outside them that would launch on a device."""
    from triton.runtime import interpreter, jit
    kernels, ops = [], []
    patched = []
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            name = getattr(self, "__name__", None) or self.fn.__name__
            kernels.append(name)
            with record_function("triton::" + name):
                return _real(self, *args, **kwargs)
        cls.run = run
        patched.append((cls, real))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield kernels, ops
    finally:
        for cls, real in patched:
            cls.run = real
    for e in prof.events():
        if e.cpu_children or not e.name.startswith("aten::") or e.name in NO_LAUNCH:
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None:
            inside = inside or parent.name.startswith("triton::")
            parent = parent.cpu_parent
        if not inside:
            ops.append(e.name)


def module_step(device):
    g = torch.Generator().manual_seed(0)
    N, K, D, B = 64, 8, 16, 32
    centres = torch.randn(N, D, generator=g)
    bank = nnkloss.CentreBank(centres, torch.arange(N) % 5,
                              neighbours=torch.randint(0, N, (N, K), generator=g)).to(device)
    loss_fn = nnkloss.NeighbourKernelLoss(bank, sigma=0.9, backend="triton")
    idx = torch.randperm(N, generator=g)[:B].to(device)
    x = (centres[idx.cpu()] + 0.1).to(device).requires_grad_(True)
    labels = bank.centre_labels[idx]

    def step():
        x.grad = None
        loss = loss_fn(x, labels, idx)
        loss.backward()
        return loss
    return step, loss_fn, x


@pytest.mark.interpreter
def test_a_module_step_makes_at_most_four_launches():
    """Value checks off, sigma and weights fixed: the batch's lists, the forward with its
    counted mean, autograd's seed of the backward and the embedding gradient; nothing else
    (no counts cleared, no mean, mask or division of its own, no sigma)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step, loss_fn, x = module_step(device)
    with nnkloss.value_checks(False):
        step()  # first call: caches (the sigma, the tickets)
        with count_launches() as (kernels, ops):
            loss = step()
    assert kernels == ["_batch_lists_kernel", "_nk_fwd_kernel", "_scale_rows_kernel"], kernels
    assert ops == ["aten::fill_"], ops  # autograd's ones for loss.backward()
    assert len(kernels) + len(ops) <= 4
    # the same numbers and gradient as the torch route on the same batch
    got = (loss.detach(), x.grad.clone(), loss_fn.last_stats.counted)
    loss_fn.backend = "torch"
    with nnkloss.value_checks(False):
        want = (step().detach(), x.grad, loss_fn.last_stats.counted)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.equal(got[2], want[2]) and bool(got[2].any())


@pytest.mark.interpreter
def test_the_mean_and_the_counts_leave_their_tickets_at_zero():
    """The forward's counted mean and the batch lists' counts are summed by the last program
    to take a ticket, which resets it: launch after launch the same figures, the tickets 0."""
    from nnkloss.kernels import neighbour_kernel as nk
    from nnkloss.ops import reference
    kernels = nnkloss.ops.backends.kernels()
    g = torch.Generator().manual_seed(3)
    B, N, D, K = 37, 50, 16, 8
    emb, centres = torch.randn(B, D, generator=g), torch.randn(N, D, generator=g)
    labels, cl = torch.randint(0, 3, (B,), generator=g), torch.randint(0, 3, (N,), generator=g)
    nb = torch.randint(-1, N, (B, K), generator=g)
    emb[4, 0] = float("nan")
    s = torch.tensor(1.3)
    ref = reference.forward(emb, labels, centres, cl, nb, None, s)
    counted = reference.counted_rows(ref[2])
    for cfg in (None, kernels.FwdConfig(4, 16, num_warps=1, rows=4)):
        for _ in range(2):
            out = kernels.neighbour_kernel_fwd(emb, labels, centres, cl, nb, None, s,
                                               config=cfg, mean=True)
            assert torch.equal(out[5], counted) and torch.isnan(out[6])
            assert int(out[7]) == int(counted.sum())
    emb[4, 0] = 0.0
    ref = reference.forward(emb, labels, centres, cl, nb, None, s)
    out = kernels.neighbour_kernel_fwd(emb, labels, centres, cl, nb, None, s, mean=True)
    torch.testing.assert_close(out[6], ref[0].sum() / counted.sum())
    table = torch.randint(-1, N, (N, K), generator=g)
    idx = torch.randint(0, N, (B,), generator=g)
    idx[[3, 9]] = torch.tensor([N + 5, -1])
    own = cl[idx.clamp(0, N - 1)].clone()
    own[7] += 1
    for _ in range(2):
        lists, counts = kernels.batch_lists(table, idx, own, cl, True)
        assert counts.tolist() == [3, 2]
    assert not nk.ticket(emb.device).any() and not nk.ticket(emb.device, 1).any()
