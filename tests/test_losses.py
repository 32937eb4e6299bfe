"""nnkloss/losses: BankLoss (base.py: checks, lists, self-exclusion, reduction, stats) and
NeighbourKernelLoss (neighbour_kernel.py: state_dict, learnable sigma and weights, backends).
ClassConditionalLoss (ccml.py) has tests/test_ccml.py; CentreBank tests/test_centre_bank.py."""
import contextlib

import pytest
import torch

import nnkloss
from cases import nonuniform, own_row_bank as make_bank, random_bank, small_bank
from reference import reference_loss


def test_self_exclusion_matches_functional_with_padding():
    bank = make_bank()
    idx = torch.tensor([3, 7, 7, 0, 29])
    emb = torch.randn(5, 6)
    labels = bank.centre_labels[idx]
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=1.5)(emb, labels, idx)
    nb = bank.neighbours[idx].clone()
    nb[nb == idx[:, None]] = -1
    ref = reference_loss(emb, labels, bank.centres, bank.centre_labels, nb, sigma=1.5)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    # Without exclusion the result differs (each row's own centre is its own class).
    kept = nnkloss.NeighbourKernelLoss(bank, sigma=1.5, exclude_self=False)(emb, labels, idx)
    assert not torch.allclose(kept, loss)


def test_last_stats_count_rows_without_positive():
    bank = make_bank(N=12, C=12, K=3)  # every centre its own class: almost no positives
    idx = torch.arange(12)
    fn = nnkloss.NeighbourKernelLoss(bank)
    fn(torch.randn(12, 6), bank.centre_labels, idx)
    assert fn.last_stats.counted.shape == (12,)
    assert int(fn.last_num_counted) == int(fn.last_stats.counted.sum())
    assert int(fn.last_num_counted) < 12


def test_state_dict_round_trip_including_size_changes():
    bank = make_bank(learn_weights=True)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=2.0, learn_sigma=True)
    with torch.no_grad():
        bank.log_weights.add_(torch.randn(30) * 0.1)
    sd = fn.state_dict()
    other = nnkloss.NeighbourKernelLoss(make_bank(N=12, D=6, K=2, seed=3, learn_weights=True),
                                        sigma=1.0, learn_sigma=True)
    other.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(other.state_dict()[k], v), k
    emb = torch.randn(4, 6)
    idx = torch.tensor([1, 2, 3, 4])
    torch.testing.assert_close(fn(emb, bank.centre_labels[idx], idx),
                               other(emb, other.bank.centre_labels[idx], idx))


def test_to_moves_everything():
    fn = nnkloss.NeighbourKernelLoss(make_bank(), sigma=1.0).to(torch.float64)
    # Buffers of integer dtype stay integer (int32: 4 bytes per neighbour index and label);
    # floating buffers follow .to(dtype).
    assert fn.bank.centre_labels.dtype == torch.int32
    assert fn.bank.neighbours.dtype == torch.int32
    assert fn.bank.centres.dtype == torch.float64


def test_learnable_weights_stay_positive_and_learn_sigma():
    bank = make_bank(N=20, K=6, learn_weights=True)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0, learn_sigma=True)
    params = list(fn.parameters())
    assert any(p is bank.log_weights for p in params) and any(p is fn.log_sigma for p in params)
    opt = torch.optim.SGD(params, lr=2.0)  # large steps: a raw weight could go negative
    idx = torch.arange(20)
    emb = bank.centres + 0.3 * torch.randn(20, 6)
    for _ in range(5):
        opt.zero_grad()
        loss = fn(emb, bank.centre_labels, idx)
        loss.backward()
        assert bank.log_weights.grad is not None and fn.log_sigma.grad is not None
        opt.step()
    # exp(log_weights) is positive by construction: what can fail is that the weights were
    # learned (moved far, some well below 1) and that the loss uses exactly these weights.
    w = bank.weights.detach()
    assert (w > 0).all() and torch.isfinite(w).all() and fn.kernel_sigma() > 0
    assert (w - 1).abs().max() > 0.1 and fn.kernel_sigma() != 1.0
    nb = bank.neighbours_for(idx)
    ref = reference_loss(emb, bank.centre_labels, bank.centres, bank.centre_labels, nb, w, fn.sigma_tensor().detach())
    torch.testing.assert_close(fn(emb, bank.centre_labels, idx).double(), ref, rtol=1e-5, atol=1e-6)


def test_fixed_weights_get_no_grad_and_skip_weight_gather():
    bank = make_bank()
    assert bank.weights_for_loss() is None
    fn = nnkloss.NeighbourKernelLoss(bank)
    fn(torch.randn(3, 6, requires_grad=True), bank.centre_labels[:3], torch.arange(3)).backward()
    assert bank.log_weights.grad is None


def test_no_neighbour_lists_is_a_clear_error():
    bank = nnkloss.CentreBank(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no neighbour lists"):
        nnkloss.NeighbourKernelLoss(bank)(torch.randn(2, 3), torch.zeros(2, dtype=torch.long),
                                          torch.tensor([0, 1]))


def test_idx_out_of_range_names_idx():
    bank = make_bank(N=10)
    with pytest.raises(IndexError, match="idx"):
        nnkloss.NeighbourKernelLoss(bank)(torch.randn(2, 6), torch.zeros(2, dtype=torch.long),
                                          torch.tensor([0, 10]))


def test_module_bad_arguments():
    bank = make_bank()
    with pytest.raises(ValueError, match="sigma"):
        nnkloss.NeighbourKernelLoss(bank, sigma=0.0)
    with pytest.raises(ValueError, match="reduction"):
        nnkloss.NeighbourKernelLoss(bank, reduction="avg")
    with pytest.raises(TypeError, match="bank"):
        nnkloss.NeighbourKernelLoss(torch.randn(3, 3))


@pytest.mark.interpreter
def test_module_backends_agree_with_learned_parameters():
    """The module on the Triton kernel (interpreter on CPU) equals the torch path, gradients
    of the network output, sigma and the learned weights included."""
    results = {}
    for backend in ("torch", "triton"):
        bank = make_bank(N=25, K=7, learn_weights=True, seed=4)
        with torch.no_grad():
            bank.log_weights.copy_(torch.linspace(-0.5, 0.5, 25))
        fn = nnkloss.NeighbourKernelLoss(bank, sigma=0.9, learn_sigma=True, backend=backend)
        idx = torch.tensor([0, 5, 5, 12, 24, 3])
        emb = (bank.centres[idx] + 0.2).requires_grad_(True)
        loss = fn(emb, bank.centre_labels[idx], idx)
        loss.backward()
        results[backend] = [loss, emb.grad, fn.log_sigma.grad, bank.log_weights.grad]
    for a, b in zip(results["torch"], results["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- misaligned idx (issue 18)
def _aligned_batch(bank, B=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(bank.num_centres, generator=g)[:B]
    emb = bank.centres[idx] + 0.1 * torch.randn(B, bank.dim, generator=g)
    return emb, bank.centre_labels[idx].long(), idx


@pytest.mark.parametrize("cls", ["nngk", "ccml"])
def test_misaligned_idx_raises_naming_idx_and_labels(cls):
    """labels that disagree with bank.centre_labels[idx] (a loader whose idx is off by one): before
    issue 18 a plausible loss came back; with value checks on it is an error."""
    bank = make_bank(N=30, C=3)
    fn = (nnkloss.NeighbourKernelLoss(bank, sigma=1.0) if cls == "nngk"
          else nnkloss.ClassConditionalLoss(bank, k=2, sigma=1.0))
    emb, labels, idx = _aligned_batch(bank)
    shifted = (idx + 1) % bank.num_centres                  # off by one
    assert bool((bank.centre_labels[shifted] != labels).any())
    with pytest.raises(ValueError, match=r"labels disagree with the bank's centre_labels at idx .*"
                                         r"idx\[\d+\] = \d+, whose centre label is \d+, but "
                                         r"labels\[\d+\] = \d+"):
        fn(emb, labels, shifted)
    fn(emb, labels, idx)                                    # aligned: fine
    assert int(fn.last_stats.num_mismatched) == 0 and int(fn.last_num_mismatched) == 0


def test_cpu_lists_and_label_comparison_are_one_compiled_call(monkeypatch):
    """CPU tensors, the compiled library loaded: the batch's lists, the own-index exclusion and
    the labels' comparison are one call (nnkloss.cpu.batch_lists, the CPU twin of
    kernels/batch_lists.py), value checks on or off. A disagreement raises the message naming
    idx and labels with the checks on and is dropped and counted with them off; an idx outside
    the bank raises IndexError naming idx either way (reading the counts is no sync on a
    CPU)."""
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("the compiled CPU kernel is unavailable here")
    counts = []
    real = cpu.batch_lists

    def spy(*args):
        out = real(*args)
        counts.append(list(out[1]))
        return out
    monkeypatch.setattr(cpu, "batch_lists", spy)
    bank = make_bank(N=30, C=3)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0)
    emb, labels, idx = _aligned_batch(bank)
    fn(emb, labels, idx)
    assert counts == [[0, 0]] and int(fn.last_num_mismatched) == 0
    with pytest.raises(ValueError, match=r"labels disagree with the bank's centre_labels"):
        fn(emb, labels, (idx + 1) % bank.num_centres)
    assert counts[1][0] > 0
    far = idx.clone()
    far[2] = 30
    for checks in (True, False):
        with nnkloss.value_checks(checks), pytest.raises(IndexError, match="idx holds 30"):
            fn(emb, labels, far)
    assert counts[2:] == [[1, 1], [1, 1]]
    bad = labels.clone()
    bad[[0, 3]] = (bad[[0, 3]] + 1) % 3
    with nnkloss.value_checks(False):
        fn(emb, bad, idx)  # checks off: dropped and counted
    assert counts[4:] == [[2, 0]] and int(fn.last_num_mismatched) == 2
    assert not fn.last_stats.counted[[0, 3]].any()


@pytest.mark.parametrize("cls", ["nngk", "ccml"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_misaligned_rows_are_dropped_and_counted_without_checks(reduction, cls):
    """With value checks off (no host sync) disagreeing rows are dropped: zero loss and zero
    gradient, out of the mean, counted in last_stats.num_mismatched (a 0-dim tensor); the
    other rows give exactly what they give alone. Both losses (the drop empties the rows'
    lists, which every loss's rows() must treat so)."""
    bank = make_bank(N=30, C=3)
    fn = (nnkloss.NeighbourKernelLoss(bank, sigma=1.0, reduction=reduction) if cls == "nngk"
          else nnkloss.ClassConditionalLoss(bank, k=2, sigma=1.0, reduction=reduction))
    emb, labels, idx = _aligned_batch(bank, B=10)
    bad = labels.clone()
    bad[[1, 4, 7]] = (labels[[1, 4, 7]] + 1) % 3
    keep = torch.ones(10, dtype=torch.bool)
    keep[[1, 4, 7]] = False
    x = emb.clone().requires_grad_()
    with nnkloss.value_checks(False):
        out = fn(x, bad, idx)
    stats = fn.last_stats
    assert stats.num_mismatched.dim() == 0 and int(stats.num_mismatched) == 3
    loss, per_row, valid = stats                            # still the 3-tuple
    assert not valid[~keep].any() and torch.equal(per_row[~keep], torch.zeros(3))
    out.sum().backward()
    assert torch.equal(x.grad[~keep], torch.zeros(3, bank.dim))
    x2 = emb[keep].clone().requires_grad_()
    alone = fn(x2, labels[keep], idx[keep])
    alone.sum().backward()
    if reduction == "none":
        torch.testing.assert_close(out[keep], alone)
    else:
        torch.testing.assert_close(out, alone)
    torch.testing.assert_close(x.grad[keep], x2.grad)
    assert int(fn.last_num_mismatched) == 0


@pytest.fixture
def one_launch_lists(monkeypatch):
    """The CUDA route of a batch's lists (kernels/batch_lists.py, one launch) on CPU tensors,
    through Triton's interpreter; yields the list of its calls."""
    from nnkloss.losses import base
    calls = []
    monkeypatch.setattr(base, "_lists_kernel", _lists_kernel_stand_in(calls))
    return calls


def _lists_kernel_stand_in(calls):
    """A ``base._lists_kernel`` that answers, for any device, the Triton launcher (run by the
    interpreter on CPU tensors), recording each launch in ``calls``."""
    launch = nnkloss.ops.backends.kernels().batch_lists

    def spy(*args):
        calls.append(1)
        return launch(*args)
    return lambda device, choice="auto": spy


def _both_routes(fn, emb, labels, idx, patch):
    """(loss, per_row, counted, num_mismatched, emb grad) of one call, lists by torch / the
    CPU library and by the one-launch kernel."""
    out = []
    for one_launch in (False, True):
        with patch() if one_launch else contextlib.nullcontext():
            x = emb.clone().requires_grad_()
            loss = fn(x, labels, idx)
            loss.sum().backward()
            s = fn.last_stats
            out.append((loss.detach(), s.per_row, s.counted, s.num_mismatched, x.grad))
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", ["nngk", "ccml"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("exclude_self", [True, False])
def test_one_launch_lists_give_what_the_torch_route_gives(monkeypatch, cls, reduction,
                                                          exclude_self):
    """On CUDA tensors the lists, exclusion and drop are one launch: the same losses, rows,
    counts and gradients as the torch / CPU-library route, aligned (checks on) and with
    misaligned rows dropped (checks off), for both losses."""
    from nnkloss.losses import base
    bank = make_bank(N=30, C=3)
    fn = (nnkloss.NeighbourKernelLoss(bank, sigma=1.0, reduction=reduction,
                                      exclude_self=exclude_self) if cls == "nngk"
          else nnkloss.ClassConditionalLoss(bank, k=2, sigma=1.0, reduction=reduction,
                                            exclude_self=exclude_self))
    emb, labels, idx = _aligned_batch(bank, B=10)
    bad = labels.clone()
    bad[[1, 4, 7]] = (labels[[1, 4, 7]] + 1) % 3
    calls = []

    @contextlib.contextmanager
    def patch():
        with monkeypatch.context() as m:
            m.setattr(base, "_lists_kernel", _lists_kernel_stand_in(calls))
            yield
    for checks, lab, dropped in ((True, labels, 0), (False, bad, 3)):
        with nnkloss.value_checks(checks):
            (l0, r0, c0, m0, g0), (l1, r1, c1, m1, g1) = _both_routes(fn, emb, lab, idx, patch)
        assert torch.equal(l0, l1) and torch.equal(r0, r1) and torch.equal(c0, c1)
        assert torch.equal(g0, g1)
        assert m1.dim() == 0 and m1.dtype == torch.int64 and int(m0) == int(m1) == dropped
    assert len(calls) == 2


@pytest.mark.interpreter
def test_one_launch_lists_check_idx_and_labels(one_launch_lists):
    """The one-launch route's checks: with value checks on a misaligned batch raises the
    message naming idx and labels, and an idx outside the bank IndexError naming idx; with
    them off such rows are dropped and counted, without a host read."""
    bank = make_bank(N=30, C=3)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0)
    emb, labels, idx = _aligned_batch(bank)
    with pytest.raises(ValueError, match=r"labels disagree with the bank's centre_labels at idx "
                                         r".*idx\[\d+\] = \d+, whose centre label is \d+"):
        fn(emb, labels, (idx + 1) % bank.num_centres)
    far = idx.clone()
    far[3] = 30
    with pytest.raises(IndexError, match="idx holds 30 but the bank has rows 0..29"):
        fn(emb, labels, far)
    far[5] = -2
    with pytest.raises(IndexError, match="idx holds -2"):
        fn(emb, labels, far)
    assert len(one_launch_lists) == 3
    x = emb.clone().requires_grad_()
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0, backend="torch")  # the CPU's reads sigma
    with nnkloss.value_checks(False), no_host_reads(allowed_callers=()):
        loss = fn(x, labels, far)
        loss.backward()
    stats = fn.last_stats
    assert int(stats.num_mismatched) == 2 and not stats.counted[[3, 5]].any()
    assert torch.equal(x.grad[[3, 5]], torch.zeros(2, bank.dim))
    keep = torch.ones(8, dtype=torch.bool)
    keep[[3, 5]] = False
    torch.testing.assert_close(loss, fn(emb[keep], labels[keep], idx[keep]))
    empty = nnkloss.CentreBank(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no neighbour lists"):
        nnkloss.NeighbourKernelLoss(empty)(torch.randn(2, 3), torch.zeros(2, dtype=torch.long),
                                           torch.tensor([0, 1]))


@pytest.mark.cuda
@pytest.mark.parametrize("cls", ["nngk", "ccml"])
def test_one_launch_lists_on_cuda_match_the_cpu(cls):
    """On a GPU the module takes the one-launch lists (kernels/batch_lists.py): the same
    losses, counts and gradients as on the CPU, misaligned and out-of-bank rows dropped and
    counted with the checks off, both errors with them on."""
    bank = make_bank(N=300, C=3, K=40)
    emb, labels, idx = _aligned_batch(bank, B=200)
    bad, far = labels.clone(), idx.clone()
    bad[::7] = (labels[::7] + 1) % 3
    far[::11] = 300
    out = {}
    for device in ("cpu", "cuda"):
        b = make_bank(N=300, C=3, K=40).to(device)
        fn = (nnkloss.NeighbourKernelLoss(b, sigma=1.0) if cls == "nngk"
              else nnkloss.ClassConditionalLoss(b, k=2, sigma=1.0))
        # a copy on each device: on the CPU, emb.to("cpu") is emb itself, whose requires_grad
        # would then make the CUDA copy a non-leaf without a .grad
        x = emb.to(device).clone().requires_grad_()
        with nnkloss.value_checks(False):
            loss = fn(x, bad.to(device), torch.where(far == 300, 0, idx).to(device))
        loss.backward()
        out[device] = (loss.detach().cpu(), fn.last_stats.per_row.cpu(),
                       fn.last_stats.counted.cpu(), int(fn.last_num_mismatched), x.grad.cpu())
        with pytest.raises(ValueError, match="labels disagree"):
            fn(emb.to(device), bad.to(device), idx.to(device))
        if device == "cuda":
            with pytest.raises(IndexError, match="idx holds 300"):
                fn(emb.to(device), labels.to(device), far.to(device))
            with nnkloss.value_checks(False):
                fn(emb.to(device), labels.to(device), far.to(device))
            assert int(fn.last_num_mismatched) == int((far == 300).sum())
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        if isinstance(a, int):
            assert a == b
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_learned_weights_are_the_banks_and_the_loss_leaves_the_bank_alone():
    """learn_weights lives on the bank only: the loss takes no such argument and building a
    loss never changes a shared bank's setting (issue 19)."""
    bank = make_bank(learn_weights=True)
    with pytest.raises(TypeError, match="learn_weights"):
        nnkloss.NeighbourKernelLoss(bank, learn_weights=False)
    nnkloss.NeighbourKernelLoss(bank, sigma=2.0)
    assert bank.learn_weights and bank.log_weights.requires_grad
    fixed = make_bank()
    nnkloss.NeighbourKernelLoss(fixed)
    assert not fixed.learn_weights


@pytest.mark.parametrize("learn", [False, True])
def test_sigma_has_one_representation_and_two_readers(learn):
    """log_sigma (a Parameter that requires grad only when learned); kernel_sigma() a float,
    sigma_tensor() the differentiable 0-dim tensor the maths uses; no ``sigma`` attribute."""
    bank = make_bank()
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=2.5, learn_sigma=learn)
    assert isinstance(fn.log_sigma, torch.nn.Parameter) and fn.log_sigma.requires_grad == learn
    assert isinstance(fn.kernel_sigma(), float) and fn.kernel_sigma() == pytest.approx(2.5)
    t = fn.sigma_tensor()
    assert t.dim() == 0 and t.requires_grad == learn and float(t.detach()) == pytest.approx(2.5)
    assert not hasattr(fn, "sigma")
    assert fn.log_values() == {"sigma": fn.kernel_sigma()}


@pytest.mark.parametrize("cls", [nnkloss.NeighbourKernelLoss, nnkloss.ClassConditionalLoss])
def test_a_loaded_sigma_is_checked_as_the_constructor_checks_it(cls):
    """load_state_dict refuses a log_sigma whose exp (in the parameter's dtype, as the maths
    takes it) is not positive and finite, as the constructor refuses such a sigma: an inf
    log_sigma trained on a constant kernel without an error before; the loss keeps its sigma."""
    fn = cls(make_bank(), sigma=2.5)
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "0.0"),
                       (89.0, "inf"), (-104.0, "0.0")):
        sd = fn.state_dict()
        sd["log_sigma"] = torch.tensor(bad)
        with pytest.raises(ValueError, match=rf"^sigma = exp\(log_sigma\) must be positive and "
                                             rf"finite, got {shown}$"):
            fn.load_state_dict(sd)
        assert fn.kernel_sigma() == pytest.approx(2.5)
    sd["log_sigma"] = torch.tensor(88.0)   # exp: 1.65e38, finite in fp32, as sigma=1.65e38 is
    fn.load_state_dict(sd)
    assert fn.kernel_sigma() == pytest.approx(float(torch.tensor(88.0).exp()))


@pytest.mark.parametrize("cls", [nnkloss.NeighbourKernelLoss, nnkloss.ClassConditionalLoss])
def test_an_integer_loaded_log_sigma_is_checked_too(cls):
    """An integer log_sigma in a state dict is cast into the fp32 parameter by the load, so it
    is checked as a float one is: int64 100 (sigma inf) and int32 -200 (sigma 0, NaN losses)
    were loaded unchecked; a valid integer value still loads."""
    fn = cls(make_bank(), sigma=2.5)
    for bad, shown in ((torch.tensor(100), "inf"), (torch.tensor(-200, dtype=torch.int32), "0.0"),
                       (torch.tensor([100]), "inf")):
        sd = fn.state_dict()
        sd["log_sigma"] = bad
        with pytest.raises(ValueError, match=rf"^sigma = exp\(log_sigma\) must be positive and "
                                             rf"finite, got {shown}$"):
            fn.load_state_dict(sd)
        assert fn.kernel_sigma() == pytest.approx(2.5)
    sd["log_sigma"] = torch.tensor(1)
    fn.load_state_dict(sd)
    assert fn.kernel_sigma() == pytest.approx(float(torch.tensor(1.0).exp()))


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_loss_reports_its_sigma_for_logs_and_refresh_stats():
    """kernel_sigma / log_values / repr, which the Trainer reads (kills losses kernel_sigma 1,
    log_values 1 and 2, extra_repr 1)."""
    fn = nnkloss.NeighbourKernelLoss(small_bank(), sigma=1.3, reduction="sum", backend="torch")
    assert isinstance(fn.kernel_sigma(), float)
    assert fn.kernel_sigma() == pytest.approx(1.3)
    assert fn.log_values() == {"sigma": pytest.approx(1.3)}
    text = repr(fn)
    assert "sigma=1.3" in text and "learn_sigma=False" in text
    assert "reduction='sum'" in text and "backend='torch'" in text and "exclude_self=True" in text


def test_module_runs_on_the_backend_it_was_given(monkeypatch):
    """backend="triton" reaches the op: on CPU tensors without Triton's interpreter it is refused
    (not silently replaced by "auto" = torch). Kills losses rows 34."""
    bank = small_bank()
    idx = torch.arange(5)
    emb = bank.centres[idx] + 0.1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        nnkloss.NeighbourKernelLoss(bank, backend="triton")(emb, bank.centre_labels[idx], idx)
    assert torch.isfinite(nnkloss.NeighbourKernelLoss(bank, backend="torch")(emb, bank.centre_labels[idx],
                                                                             idx))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_applies_its_reduction(reduction):
    """The module's reduction and its last_stats (kills losses BankLoss.forward 23: reduction
    dropped -> "mean"; 28: last_stats.loss None)."""
    bank = small_bank()
    idx = torch.arange(8)
    emb = bank.centres[idx] + 0.3
    rows = nnkloss.NeighbourKernelLoss(bank, sigma=0.7, reduction="none")(emb, bank.centre_labels[idx], idx)
    assert rows.shape == (8,)
    valid = nnkloss.NeighbourKernelLoss(bank, sigma=0.7).last_stats  # nothing before a call
    assert valid is None
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=0.7, reduction=reduction)
    got = fn(emb, bank.centre_labels[idx], idx)
    counted = fn.last_stats.counted
    assert int(counted.sum()) >= 2 and float(rows.sum()) > 0
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted.sum()}[reduction]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fn.last_stats.loss, got.detach())
    torch.testing.assert_close(fn.last_stats.per_row, rows)


def test_module_defaults_and_backend_error():
    """Documented defaults (sigma 1.0, sigma fixed) and the error naming a bad backend (kills
    losses NeighbourKernelLoss.__init__ 1, 2, 15)."""
    fn = nnkloss.NeighbourKernelLoss(small_bank())
    assert fn.kernel_sigma() == 1.0
    assert not fn.log_sigma.requires_grad
    assert fn.reduction == "mean" and fn.backend == "auto" and fn.exclude_self
    with pytest.raises(ValueError, match="backend must be one of .*'cuda'"):
        nnkloss.NeighbourKernelLoss(small_bank(), backend="cuda")


class _CountEntries(nnkloss.BankLoss):
    """A minimal BankLoss subclass: each row's loss is the number of entries left in its list."""

    def rows(self, emb, labels, neighbours):
        per_row = (neighbours >= 0).sum(1).to(emb.dtype)
        return per_row, torch.ones_like(per_row, dtype=torch.bool)


def test_bank_loss_template_defaults_and_errors():
    """BankLoss, the public base class: the own centre is excluded by default and the reduction
    defaults to the mean; a bad bank is named with its type (kills losses BankLoss.__init__ 3,
    6, 13)."""
    bank = nnkloss.CentreBank(torch.randn(4, 2), torch.tensor([0, 0, 1, 1]),
                              neighbours=torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]]))
    fn = _CountEntries(bank)
    assert fn.last_stats is None and fn.last_num_counted is None
    loss = fn(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert float(loss) == 1.0  # own entry dropped from both lists, mean of [1, 1]
    assert int(fn.last_num_counted) == 2
    keep = _CountEntries(bank, reduction="sum", exclude_self=False)
    assert float(keep(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([0, 2]))) == 4.0
    with pytest.raises(TypeError, match="bank must be a CentreBank, got Tensor"):
        _CountEntries(torch.zeros(3))


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_bank.py (issue 14 README promises; issue 19).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads(allowed_callers=("neighbours_for", "_lists_in_one_call")):
    """Every Tensor method that copies a value to the host raises, except when called from
    ``allowed_callers`` (the bank's CPU-only idx range check, free for CPU idx and skipped
    for CUDA idx; the bank loss's read of the CPU library's one-call list counts, host memory,
    where the GPU's are read only with the checks on)."""
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
    bank = random_bank(N=40, D=8, K=6, weights=nonuniform(40), learn_weights=True).to(device)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.5, learn_sigma=True, backend=backend).to(device)
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(7, 8, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 40, (7,), generator=g).to(device)
    labels = bank.centre_labels[idx].clone()
    # Value checks off: since issue 18 they compare labels with bank.centre_labels[idx] (one read).
    with guard(), nnkloss.value_checks(False):
        loss = fn(emb, labels, idx)
        loss.backward()
        fn.last_num_counted  # noqa: B018 - a 0-dim tensor, not read
    for t in (emb.grad, bank.log_weights.grad, fn.log_sigma.grad):
        assert t is not None and torch.isfinite(t).all()
    return loss


@pytest.mark.parametrize("library_lists", [True, False])
def test_forward_and_backward_read_no_tensor_values_on_cpu(monkeypatch, library_lists):
    """No Tensor value reaches the host; without the CPU library's one-call lists (False: as
    where they do not run, e.g. traced, the misaligned rows' drop built from torch ops) too."""
    from nnkloss.losses import base
    if not library_lists:
        monkeypatch.setattr(base, "_lists_kernel", lambda device, choice="auto": None)
    loss = forward_backward_without_sync("cpu", "torch", no_host_reads)
    assert torch.isfinite(loss)


def test_on_cpu_the_drop_is_part_of_the_one_call(monkeypatch):
    """CPU tensors, the compiled library built: the lists of misaligned rows are emptied in the
    library's one call, checks off, so forward fills no lists (no masked_fill) whether rows are
    dropped or not; a dropped row has loss 0, is not counted and is counted as mismatched."""
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("no compiled CPU kernel here")
    bank = random_bank(N=40, D=8, K=6)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.5)
    idx = torch.arange(0, 40, 5)
    emb = bank.centres[idx] + 0.1
    labels = bank.centre_labels[idx].clone()
    fills = []
    real_fill = torch.Tensor.masked_fill
    monkeypatch.setattr(torch.Tensor, "masked_fill",
                        lambda *a, **k: fills.append(1) or real_fill(*a, **k))
    with nnkloss.value_checks(False):
        fn(emb, labels, idx)
        assert int(fn.last_num_mismatched) == 0
        labels[2] = labels[2] + 1
        fn(emb, labels, idx)
    assert fills == [] and int(fn.last_num_mismatched) == 1
    assert fn.last_stats.per_row[2] == 0 and not fn.last_stats.counted[2]


def test_host_read_guard_catches_a_read():
    bank = random_bank()
    fn = nnkloss.NeighbourKernelLoss(bank)
    idx = torch.arange(4)
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            fn(torch.randn(4, 6), bank.centre_labels[idx], idx).item()
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


def test_fp16_embeddings_through_the_module():
    bank = random_bank(N=20, D=6, K=5)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.2)
    idx = torch.arange(0, 20, 2)
    emb = (bank.centres[idx] + 0.3).half()
    got = fn(emb, bank.centre_labels[idx], idx)
    want = fn(emb.float(), bank.centre_labels[idx], idx)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# The BankLoss template (losses/base.py; moved from tests/test_layout.py, issue 19).
class HalfDistance(nnkloss.BankLoss):
    """A bank loss is only its maths: the template checks, gathers lists and reduces."""

    def rows(self, emb, labels, neighbours):
        c = self.bank.centres[neighbours.clamp_min(0)]
        d = ((c - emb[:, None]) ** 2).sum(-1).masked_fill(neighbours < 0, 0.0)
        return 0.5 * d.sum(1), (neighbours >= 0).any(1)


def test_bank_loss_template():
    g = torch.Generator().manual_seed(0)
    bank = nnkloss.CentreBank(torch.randn(6, 3, generator=g), torch.arange(6) % 2,
                              neighbours=torch.tensor([[1, 2], [0, 2], [0, 1], [4, 5], [3, 5],
                                                       [3, 4]]))
    emb = torch.randn(3, 3, generator=g, requires_grad=True)
    idx = torch.tensor([0, 3, 5])
    loss_fn = HalfDistance(bank)
    loss = loss_fn(emb, torch.tensor([0, 1, 1]), idx)
    expected = sum(0.5 * ((bank.centres[bank.neighbours[i]] - emb[r]) ** 2).sum()
                   for r, i in enumerate(idx.tolist())) / 3
    torch.testing.assert_close(loss, expected)
    assert int(loss_fn.last_num_counted) == 3
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        loss_fn(emb, [0, 1, 1], idx)
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        nnkloss.BankLoss(bank)
    assert isinstance(nnkloss.NeighbourKernelLoss(bank), nnkloss.BankLoss)
    assert isinstance(nnkloss.ClassConditionalLoss(bank), nnkloss.BankLoss)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_checked_call_with_every_label_aligned_drops_nothing_from_the_graph(reduction,
                                                                            monkeypatch):
    """With value checks on, the labels have been read against the bank's (a mismatch raises),
    so a call whose rows all agree fills no lists and reports 0 mismatched rows; loss, per-row
    losses, counted rows, every gradient and the autograd graph equal the unchecked call's,
    which fills the lists of no row where nothing is read (torch's route, as where the one-call
    lists do not run; here the CPU library's is taken away for it): the drop adds nothing to
    the graph (no WhereBackward)."""
    from nnkloss.losses import base
    real_lists = base._lists_kernel
    def graph_ops(t):
        seen, todo = set(), [t.grad_fn]
        while todo:
            f = todo.pop()
            if f is not None and f not in seen:
                seen.add(f)
                todo.extend(g for g, _ in f.next_functions)
        return {type(f).__name__ for f in seen}
    runs = []
    for checks in (True, False):
        bank = random_bank(N=40, D=8, K=6, weights=nonuniform(40), learn_weights=True)
        fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.5, learn_sigma=True, reduction=reduction)
        g = torch.Generator().manual_seed(21)
        emb = torch.randn(7, 8, generator=g).requires_grad_(True)
        idx = torch.randint(0, 40, (7,), generator=g)
        monkeypatch.setattr(base, "_lists_kernel",
                            real_lists if checks else (lambda device, choice="auto": None))
        with nnkloss.value_checks(checks):
            loss = fn(emb, bank.centre_labels[idx].clone(), idx)
        ops = graph_ops(loss)
        assert "WhereBackward0" not in ops
        loss.sum().backward()
        stats = fn.last_stats
        assert int(stats.num_mismatched) == 0
        runs.append([loss, stats.per_row, stats.counted, emb.grad, bank.log_weights.grad,
                     fn.log_sigma.grad, ops])
    for a, b in zip(*runs, strict=True):
        assert a == b if isinstance(a, set) else torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_idx_gives_the_int64_loss(dtype):
    """A bank loss reads idx of any integer dtype as bank rows (torch indexing would read uint8
    as a boolean mask and refuse int8 / int16)."""
    bank = make_bank(N=30, K=5)
    idx = torch.tensor([3, 7, 7, 0, 29])
    emb = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    labels = bank.centre_labels[idx]
    for loss in (nnkloss.NeighbourKernelLoss(bank, sigma=1.5),
                 nnkloss.ClassConditionalLoss(bank, k=2)):
        torch.testing.assert_close(loss(emb, labels, idx.to(dtype)), loss(emb, labels, idx),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint16, torch.int8])
def test_labels_of_any_integer_dtype_give_the_int64_loss(dtype):
    """A bank loss compares labels of any integer dtype with the bank's int32 labels (torch
    refused to promote uint16 / uint32 against them, naming no argument)."""
    bank = make_bank(N=30, K=5)
    idx = torch.tensor([3, 7, 7, 0, 29])
    emb = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    labels = bank.centre_labels[idx].long()
    for loss in (nnkloss.NeighbourKernelLoss(bank, sigma=1.5),
                 nnkloss.ClassConditionalLoss(bank, k=2)):
        want = loss(emb, labels, idx)
        torch.testing.assert_close(loss(emb, labels.to(dtype), idx), want, rtol=0, atol=0)
        with nnkloss.value_checks(False):
            torch.testing.assert_close(loss(emb, labels.to(dtype), idx), want, rtol=0, atol=0)
            assert loss.last_num_mismatched == 0


def test_a_module_call_on_the_meta_device_names_emb():
    """Meta tensors hold no values, and a bank loss reads its batch's lists and labels: the
    call is refused naming emb (it failed inside Tensor.item(), naming nothing)."""
    bank = small_bank().to("meta")
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0)
    idx = torch.arange(3, device="meta")
    with pytest.raises(ValueError, match="^emb is on the meta device"):
        fn(torch.empty(3, bank.centres.shape[1], device="meta"),
           torch.zeros(3, dtype=torch.int64, device="meta"), idx)
