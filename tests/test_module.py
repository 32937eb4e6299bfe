"""CentreBank and NeighbourKernelLoss: self-exclusion, state_dict, learnable parameters."""
import pytest
import torch

import nnkloss
from reference import reference_loss


def make_bank(N=30, D=6, K=5, C=3, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.randint(0, N, (N, K), generator=g)
    nb[:, 0] = torch.arange(N)  # every list holds its own row: must be excluded
    return nnkloss.CentreBank(centres, labels, neighbours=nb, **kw)


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


def test_exclusion_also_when_self_appears_twice():
    bank = make_bank(N=10, K=4)
    bank.set_neighbours(torch.stack([torch.tensor([i, i, (i + 1) % 10, (i + 2) % 10])
                                     for i in range(10)]))
    idx = torch.tensor([4])
    assert bank.neighbours_for(idx).tolist() == [[-1, -1, 5, 6]]


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


def test_bank_stores_int32_lists_and_labels_and_keeps_them_through_updates():
    bank = make_bank()
    assert bank.centre_labels.dtype == bank.neighbours.dtype == torch.int32
    bank.update_(centre_labels=bank.centre_labels.long(), neighbours=bank.neighbours.long())
    assert bank.centre_labels.dtype == bank.neighbours.dtype == torch.int32
    big = nnkloss.CentreBank(torch.zeros(2, 3), torch.tensor([0, 2 ** 40]))
    assert big.centre_labels.dtype == torch.int64 and int(big.centre_labels[1]) == 2 ** 40


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


def test_update_is_all_or_nothing():
    bank = make_bank(N=10, K=3)
    before = {k: v.clone() for k, v in bank.state_dict().items()}
    bad_nb = torch.full((10, 3), 10)  # index out of range
    with pytest.raises(IndexError, match="neighbours"):
        bank.update_(centres=torch.zeros(10, 6), neighbours=bad_nb)
    for k, v in bank.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_bank_growth_keeps_weights_and_clears_stale_lists():
    bank = make_bank(N=10, K=3)
    bank.update_(centres=torch.randn(12, 6), centre_labels=torch.zeros(12, dtype=torch.long))
    assert bank.num_centres == 12 and bank.weights.shape == (12,) and not bank.has_neighbours


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


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(5, dtype=torch.long)), ValueError,
     "centre_labels has length 5"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4)), TypeError,
     "^centre_labels must"),
    (dict(centres=torch.randn(4), centre_labels=torch.zeros(4, dtype=torch.long)), ValueError, "centres"),
    (dict(centres=torch.full((4, 3), float("nan")), centre_labels=torch.zeros(4, dtype=torch.long)),
     ValueError, "NaN"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4, dtype=torch.long),
          weights=-torch.ones(4)), ValueError, "weights"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4, dtype=torch.long),
          weights=torch.zeros(4), learn_weights=True), ValueError, "positive"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4, dtype=torch.long),
          neighbours=torch.tensor([[0], [1], [2], [4]])), IndexError, "neighbours"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4, dtype=torch.long),
          neighbours=torch.zeros(4, 2)), TypeError, "neighbours"),
])
def test_bank_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nnkloss.CentreBank(**kwargs)


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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_misaligned_rows_are_dropped_and_counted_without_checks(reduction):
    """With value checks off (no host sync) disagreeing rows are dropped: zero loss and zero
    gradient, out of the mean, counted in last_stats.num_mismatched (a 0-dim tensor); the
    other rows give exactly what they give alone."""
    bank = make_bank(N=30, C=3)
    fn = nnkloss.NeighbourKernelLoss(bank, sigma=1.0, reduction=reduction)
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


# ---------------------------------------------------------------- fresh centres
def test_write_centres_overwrites_rows_in_place_and_keeps_the_rest():
    bank = make_bank()
    before = bank.centres.clone()
    buf = bank.centres
    idx = torch.tensor([4, 0, 17])
    emb = torch.randn(3, 6, requires_grad=True)
    assert bank.write_centres_(idx, emb) is bank
    assert bank.centres is buf  # in place: the same buffer
    assert torch.equal(bank.centres[idx], emb.detach())
    rest = torch.ones(30, dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(bank.centres[rest], before[rest])
    assert not bank.centres.requires_grad


def test_write_centres_momentum_blends_in_fp32_and_casts_to_the_bank_dtype():
    src = make_bank()
    bank = nnkloss.CentreBank(src.centres.half(), src.centre_labels)
    old = bank.centres.float().clone()
    idx = torch.tensor([2, 9])
    emb = torch.randn(2, 6)
    bank.write_centres_(idx, emb, momentum=0.75)
    expected = (0.75 * old[idx] + 0.25 * emb).half()
    assert bank.centres.dtype == torch.float16
    assert torch.equal(bank.centres[idx], expected)


def test_write_centres_duplicates_take_the_last_occurrence():
    bank = make_bank()
    old = bank.centres.clone()
    idx = torch.tensor([5, 3, 5, 8, 3, 5])
    emb = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 6).clone()
    bank.write_centres_(idx, emb)
    assert bank.centres[5].tolist() == [5.0] * 6
    assert bank.centres[3].tolist() == [4.0] * 6
    assert bank.centres[8].tolist() == [3.0] * 6
    bank.update_(centres=old.clone())  # the bank keeps (and writes into) what it is given
    bank.write_centres_(idx, emb, momentum=0.5)  # blended with the old row, once
    torch.testing.assert_close(bank.centres[5], 0.5 * old[5] + 2.5)
    torch.testing.assert_close(bank.centres[3], 0.5 * old[3] + 2.0)


def test_write_centres_empty_batch_is_a_no_op():
    bank = make_bank()
    before = bank.centres.clone()
    bank.write_centres_(torch.zeros(0, dtype=torch.long), torch.zeros(0, 6))
    assert torch.equal(bank.centres, before)


@pytest.mark.parametrize("idx, emb, kw, exc, match", [
    (torch.tensor([1.0]), torch.randn(1, 6), {}, TypeError, "idx"),
    (torch.tensor([[1]]), torch.randn(1, 6), {}, ValueError, "idx"),
    (torch.tensor([1]), torch.randn(1, 5), {}, ValueError, "emb"),
    (torch.tensor([1, 2]), torch.randn(1, 6), {}, ValueError, "emb"),
    (torch.tensor([1]), torch.ones(1, 6, dtype=torch.long), {}, TypeError, "emb"),
    (torch.tensor([1]), torch.randn(1, 6, device="meta"), {}, ValueError, "emb is on meta"),
    (torch.tensor([30]), torch.randn(1, 6), {}, IndexError, "idx holds 30"),
    (torch.tensor([-1]), torch.randn(1, 6), {}, IndexError, "idx holds -1"),
    (torch.tensor([1]), torch.randn(1, 6), {"momentum": 1.0}, ValueError, "momentum"),
    (torch.tensor([1]), torch.randn(1, 6), {"momentum": -0.1}, ValueError, "momentum"),
    (torch.tensor([1]), torch.randn(1, 6), {"momentum": True}, TypeError, "momentum"),
    (torch.tensor([1]), torch.randn(1, 6), {"momentum": "0.5"}, TypeError, "momentum"),
])
def test_write_centres_bad_input_leaves_the_bank(idx, emb, kw, exc, match):
    bank = make_bank()
    before = bank.centres.clone()
    with pytest.raises(exc, match=match):
        bank.write_centres_(idx, emb, **kw)
    assert torch.equal(bank.centres, before)


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
