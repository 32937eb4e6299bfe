"""README promises of CentreBank / NeighbourKernelLoss / the op that had no test (issue 14):
state_dict with fixed non-uniform weights, "forward never syncs", fp16 embeddings, growing a
bank whose weights are learned."""
import contextlib

import pytest
import torch

import nnkloss
from reference import reference_loss

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def make_bank(N=30, D=6, K=5, C=3, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.randint(0, N, (N, K), generator=g)
    return nnkloss.CentreBank(centres, labels, neighbours=nb, **kw)


def nonuniform(n, seed=1):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 3 + 0.1


# ---------------------------------------------------------------- state_dict
def test_load_state_dict_restores_fixed_nonuniform_weights():
    src = nnkloss.NeighbourKernelLoss(make_bank(weights=nonuniform(30)), sigma=1.3)
    dst = nnkloss.NeighbourKernelLoss(make_bank(), sigma=1.3)  # same size, uniform weights
    assert dst.bank.weights_for_loss() is None
    idx = torch.arange(0, 30, 3)
    emb = torch.randn(len(idx), 6, generator=torch.Generator().manual_seed(2))
    labels = src.bank.labels[idx]
    want = src(emb, labels, idx)
    assert not torch.allclose(want, dst(emb, labels, idx))  # the weights matter here
    dst.load_state_dict(src.state_dict())
    assert not dst.bank.learn_weights
    torch.testing.assert_close(dst.bank.weights_for_loss(), nonuniform(30))
    torch.testing.assert_close(dst(emb, labels, idx), want)
    # ... and back: uniform weights loaded into a weighted bank make it uniform again.
    src.load_state_dict(nnkloss.NeighbourKernelLoss(make_bank(), sigma=1.3).state_dict())
    assert src.bank.weights_for_loss() is None
    uniform = nnkloss.NeighbourKernelLoss(make_bank(), sigma=1.3)
    torch.testing.assert_close(src(emb, labels, idx), uniform(emb, labels, idx))


def test_save_load_bank_keeps_fixed_nonuniform_weights(tmp_path):
    bank = make_bank(weights=nonuniform(30, seed=4))
    nnkloss.save_bank(bank, tmp_path / "bank.pt")
    loaded, _, _ = nnkloss.load_bank(tmp_path / "bank.pt")
    assert not loaded.learn_weights
    torch.testing.assert_close(loaded.weights_for_loss(), bank.weights_for_loss())


# ---------------------------------------------------------------- never syncs
@contextlib.contextmanager
def no_host_reads(allowed_callers=("neighbours_for",)):
    """Every Tensor method that copies a value to the host raises, except when called from
    ``allowed_callers`` (the bank's CPU-only idx range check, free for CPU idx and skipped
    for CUDA idx)."""
    import sys
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    calls = []

    def guard(name):
        orig = saved[name]

        def wrapper(self, *a, **k):
            caller = sys._getframe(1).f_code.co_name
            # "in", not "==": mutmut renames functions (...neighbours_for__mutmut_orig).
            if not any(ok in caller for ok in allowed_callers):
                calls.append((name, caller))
                raise AssertionError(f"host read Tensor.{name} from {caller}()")
            return orig(self, *a, **k)
        return wrapper

    for name in HOST_READS:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def forward_backward_without_sync(device, backend, guard):
    bank = make_bank(N=40, D=8, K=6, weights=nonuniform(40), learn_weights=True).to(device)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.5, learn_sigma=True, backend=backend).to(device)
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(7, 8, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 40, (7,), generator=g).to(device)
    labels = bank.labels[idx].clone()
    # Value checks off: since issue 18 they compare labels with bank.labels[idx] (one read).
    with guard(), nnkloss.value_checks(False):
        loss = fn(emb, labels, idx)
        loss.backward()
        fn.last_num_counted  # noqa: B018 - a 0-dim tensor, not read
    for t in (emb.grad, bank.log_weights.grad, fn.log_sigma.grad):
        assert t is not None and torch.isfinite(t).all()
    return loss


def test_forward_and_backward_read_no_tensor_values_on_cpu():
    loss = forward_backward_without_sync("cpu", "torch", no_host_reads)
    assert torch.isfinite(loss)


def test_host_read_guard_catches_a_read():
    bank = make_bank()
    fn = nnkloss.NeighbourKernelLoss(bank)
    idx = torch.arange(4)
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            fn(torch.randn(4, 6), bank.labels[idx], idx).item()
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            fn.kernel_sigma()  # what a careless forward (extra_repr style) would do


@pytest.mark.cuda
def test_forward_and_backward_never_sync_on_cuda():
    @contextlib.contextmanager
    def sync_error():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    loss = forward_backward_without_sync("cuda", "auto", sync_error)
    assert torch.isfinite(loss.cpu())


# ---------------------------------------------------------------- fp16 embeddings
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bank_dtype", [torch.float16, torch.float32])
def test_fp16_embeddings(backend, bank_dtype):
    g = torch.Generator().manual_seed(6)
    emb = torch.randn(6, 12, generator=g).half().requires_grad_(True)
    centres = torch.randn(30, 12, generator=g).to(bank_dtype)
    labels = torch.randint(0, 3, (6,), generator=g)
    cl = torch.randint(0, 3, (30,), generator=g)
    nb = torch.randint(0, 30, (6, 9), generator=g)
    w = (torch.rand(30, generator=g) + 0.5).requires_grad_(True)
    loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma=1.7,
                                         backend=backend)
    assert loss.dtype == torch.float32  # fp32 math for fp16 input
    loss.backward()
    assert emb.grad.dtype == torch.float16
    e64 = emb.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = reference_loss(e64, labels, centres.double(), cl, nb, w64, 1.7)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(emb.grad.double(), e64.grad.half().double(), rtol=1.6e-2,
                               atol=1e-3)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-3, atol=1e-5)


def test_fp16_embeddings_through_the_module():
    bank = make_bank(N=20, D=6, K=5)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.2)
    idx = torch.arange(0, 20, 2)
    emb = (bank.centres[idx] + 0.3).half()
    got = fn(emb, bank.labels[idx], idx)
    want = fn(emb.float(), bank.labels[idx], idx)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- growing a learned bank
def test_growing_a_learned_bank_keeps_the_parameter_in_a_user_optimiser():
    bank = make_bank(N=20, K=5, learn_weights=True)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0)
    param = bank.log_weights
    opt = torch.optim.SGD(fn.parameters(), lr=0.5)  # plain SGD: no per-parameter state
    bank.add(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))
    assert bank.num_centres == 24 and bank.log_weights.shape == (24,)
    assert bank.log_weights is param, "add() replaced the learned parameter: optimisers " \
                                      "holding it silently stop training the weights"
    assert bank.learn_weights
    bank.rebuild_neighbours(k=6, search_backend="torch")  # the new centres enter the lists
    before = bank.log_weights.detach().clone()
    idx = torch.arange(24)
    emb = bank.centres + 0.2 * torch.randn(24, 6)
    opt.zero_grad()
    fn(emb, bank.labels, idx).backward()
    opt.step()
    moved = bank.log_weights.detach() != before
    assert moved[:20].any() and moved[20:].any()  # old and new weights both train


def test_growing_a_learned_bank_with_given_weights_keeps_the_parameter():
    bank = make_bank(N=10, K=3, learn_weights=True)
    param = bank.log_weights
    bank.add(torch.randn(2, 6), torch.tensor([0, 1]), weights=torch.tensor([2.0, 0.5]))
    assert bank.log_weights is param and bank.log_weights.requires_grad
    torch.testing.assert_close(bank.weights.detach()[10:], torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(bank.weights.detach()[:10], torch.ones(10))


# ---------------------------------------------------------------- mutation survivors (bank.py)
# Each test below kills mutants that survived the trial run recorded in tests/MUTATION.md.
@pytest.mark.parametrize("kwargs, exc, match", [
    # README: bad input raises an exception that names the argument (and the numbers).
    (dict(neighbours=torch.zeros(5, 2, dtype=torch.long)), ValueError,
     r"neighbours must have one row per centre \(4\), got 5"),
    (dict(neighbours=torch.tensor([[1], [0], [-2], [2]])), IndexError,
     r"neighbours holds index -2; the only negative index allowed is -1"),
    (dict(neighbours=torch.tensor([[1], [0], [4], [2]])), IndexError,
     r"neighbours holds index 4 but the bank has only 4 centres"),
    (dict(weights=torch.ones(3)), ValueError, r"weights has length 3 but the bank has 4 centres"),
    (dict(weights=torch.ones(4, dtype=torch.long)), TypeError, r"^weights must"),
    (dict(weights=torch.tensor([1.0, -1.0, 1.0, 1.0])), ValueError,
     r"^weights must be finite and non-negative$"),
    (dict(weights=torch.tensor([1.0, 0.0, 1.0, 1.0]), learn_weights=True), ValueError,
     r"^learnable weights must start strictly positive \(they are stored as log-weights"),
])
def test_bank_errors_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nnkloss.CentreBank(torch.zeros(4, 2), torch.tensor([0, 0, 1, 1]), **kwargs)


def test_bank_constructor_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"^centres must have dtype"):
        nnkloss.CentreBank(torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"^labels must"):
        nnkloss.CentreBank(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(ValueError, match=r"^centres contain NaN or inf$"):
        nnkloss.CentreBank(torch.full((4, 2), float("inf")), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^labels are on meta but centres on cpu$"):
        nnkloss.CentreBank(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long, device="meta"))


def test_neighbours_for_errors_and_empty_idx():
    bank = make_bank(N=10, K=3)
    with pytest.raises(IndexError, match=r"^idx holds -1 but the bank has rows 0\.\.9$"):
        bank.neighbours_for(torch.tensor([0, -1, 12]))
    with pytest.raises(IndexError, match=r"^idx holds 10 but the bank has rows 0\.\.9$"):
        bank.neighbours_for(torch.tensor([0, 10]))
    with pytest.raises(IndexError, match=r"^idx holds 12 but"):
        bank.neighbours_for(torch.tensor([0, 12]))  # lowest index 0: the highest is the bad one
    with pytest.raises(TypeError, match=r"^idx must"):
        bank.neighbours_for(torch.tensor([0.0]))
    out = bank.neighbours_for(torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 3) and out.dtype == bank.neighbours.dtype == torch.int32
    plain = nnkloss.CentreBank(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"^the bank has no neighbour lists yet: build them "
                                           r"first \(rebuild_neighbours / set_neighbours / "
                                           r"a Refresher\)$"):
        plain.neighbours_for(torch.tensor([0]))


def test_rebuild_neighbours_passes_its_options_on():
    # Class 0 has two points far apart (rows 6 and 7), each surrounded by class 1: with k = 2
    # neither lists the other unless ensure_positive patches it in.
    centres = torch.tensor([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2], [10.0], [0.05]])
    labels = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0])
    bank = nnkloss.CentreBank(centres, labels)
    lists = bank.rebuild_neighbours(k=2, search_backend="torch")  # default: no patching
    assert lists.num_patched == 0 and lists.search_backend == "torch"
    assert 7 not in bank.neighbours[6].tolist() and 6 not in bank.neighbours[7].tolist()
    lists = bank.rebuild_neighbours(k=2, search_backend="torch", ensure_positive=True)
    assert lists.num_patched == 2
    assert 7 in bank.neighbours[6].tolist() and 6 in bank.neighbours[7].tolist()
    with pytest.raises(ValueError, match="approximate"):
        bank.rebuild_neighbours(k=2, search_backend="torch", approximate="no-such-index")
    lists = bank.rebuild_neighbours(k=2)  # the default backend ("auto") works
    assert lists.search_backend in ("torch", "faiss") and bank.k == 2


def test_from_class_means_uses_its_seed():
    from nnkloss.bank.centroids import class_centroids
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(60, 3, generator=g)
    labels = torch.arange(60) % 2
    for seed in (0, 3):
        c, l = class_centroids(emb, labels, per_class=3, seed=seed)
        bank = nnkloss.CentreBank.from_class_means(emb, labels, per_class=3, seed=seed)
        assert torch.equal(bank.centres, c) and torch.equal(bank.labels, l)
    default = nnkloss.CentreBank.from_class_means(emb, labels, per_class=3)
    assert torch.equal(default.centres, class_centroids(emb, labels, per_class=3, seed=0)[0])
    assert not torch.equal(class_centroids(emb, labels, per_class=3, seed=0)[0],
                           class_centroids(emb, labels, per_class=3, seed=3)[0])


def test_bank_load_state_dict_strictness():
    bank = make_bank(N=8, K=2)
    sd = bank.state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        make_bank(N=8, K=2).load_state_dict({**sd, "bogus": torch.zeros(1)})
    partial = {k: v for k, v in sd.items() if k != "log_weights"}
    with pytest.raises(RuntimeError, match="Missing key"):
        make_bank(N=8, K=2).load_state_dict(partial)
    other = make_bank(N=8, K=2, weights=nonuniform(8))
    other.load_state_dict(partial, strict=False)  # weights kept, nothing else breaks
    torch.testing.assert_close(other.weights_for_loss(), nonuniform(8))
    assert torch.equal(other.centres, bank.centres)
