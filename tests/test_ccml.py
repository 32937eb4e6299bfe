"""Class-conditional loss (CCML Eq. 15) against a plain per-row reference, values and gradients."""
import inspect
import math

import pytest
import torch

import nnkloss
from nnkloss import CentreBank, ClassConditionalLoss, class_conditional_loss
from nnkloss.ops import reference as torch_path


def reference_rows(emb, labels, centres, centre_labels, neighbours, k, sigma, weights=None,
                   objective="accuracy"):
    """Row by row from Eq. 15: plain autograd-friendly fp64 expressions."""
    rows, valid = [], []
    s = 1.0 / (2 * sigma ** 2)
    for b in range(emb.shape[0]):
        pos, neg = [], []
        for j in neighbours[b].tolist():
            if j < 0 or (weights is not None and float(weights[j]) == 0):
                continue
            d = ((emb[b] - centres[j]) ** 2).sum()
            (pos if int(centre_labels[j]) == int(labels[b]) else neg).append(d)
        if not pos or not neg:
            rows.append(emb.new_zeros(()) + 0 * emb[b].sum())
            valid.append(False)
            continue
        pos = sorted(pos, key=lambda t: float(t.detach()))[:k]
        neg = sorted(neg, key=lambda t: float(t.detach()))[:k]
        m_pos = torch.stack(pos).mean()
        m_neg = torch.stack(neg).mean()
        p = torch.exp(-s * m_pos) / (torch.exp(-s * m_pos) + torch.exp(-s * m_neg))
        rows.append(1 - p if objective == "accuracy" else -torch.log(p))
        valid.append(True)
    return torch.stack(rows), torch.tensor(valid)


def problem(B=12, N=30, D=5, K=10, C=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, D, generator=g, dtype=dtype)
    centres = torch.randn(N, D, generator=g, dtype=dtype)
    labels = torch.randint(0, C, (B,), generator=g)
    centre_labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)])
    nb[0, :3] = -1  # padding
    return emb, labels, centres, centre_labels, nb


@pytest.mark.parametrize("objective", ["accuracy", "nll"])
@pytest.mark.parametrize("k", [1, 3, 20])
def test_matches_reference_values_and_grads(objective, k):
    emb, labels, centres, centre_labels, nb = problem()
    sigma = 0.9
    e1, c1 = emb.clone().requires_grad_(True), centres.clone().requires_grad_(True)
    out = class_conditional_loss(e1, labels, c1, centre_labels, nb, k=k, sigma=sigma,
                                 objective=objective, reduction="none")
    e2, c2 = emb.clone().requires_grad_(True), centres.clone().requires_grad_(True)
    ref, valid = reference_rows(e2, labels, c2, centre_labels, nb, k, sigma,
                                objective=objective)
    torch.testing.assert_close(out, ref)
    w = torch.randn(emb.shape[0], dtype=torch.float64)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(e1.grad, e2.grad)
    torch.testing.assert_close(c1.grad, c2.grad)
    mean = class_conditional_loss(emb, labels, centres, centre_labels, nb, k=k, sigma=sigma,
                                  objective=objective)
    torch.testing.assert_close(mean, ref.sum() / valid.sum())


def test_gradcheck_fp64():
    emb, labels, centres, centre_labels, nb = problem(B=6, N=15, D=3, K=8, seed=1)
    e = emb.clone().requires_grad_(True)
    c = centres.clone().requires_grad_(True)
    for objective in ("accuracy", "nll"):
        assert torch.autograd.gradcheck(
            lambda e_, c_: class_conditional_loss(e_, labels, c_, centre_labels, nb, k=2,
                                                  sigma=1.1, objective=objective,
                                                  reduction="none"),
            (e, c), eps=1e-6, atol=1e-6)


def test_default_sigma_is_eq15_as_printed():
    emb, labels, centres, centre_labels, nb = problem(seed=2)
    out = class_conditional_loss(emb, labels, centres, centre_labels, nb, k=2, reduction="none")
    ref, _ = reference_rows(emb, labels, centres, centre_labels, nb, 2, math.sqrt(0.5))
    torch.testing.assert_close(out, ref)


def test_rows_without_both_sides_are_left_out():
    centres = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    centre_labels = torch.tensor([0, 0, 1])
    emb = torch.tensor([[0.1, 0.1], [0.2, 0.0], [0.3, 0.3]], dtype=torch.float64,
                       requires_grad=True)
    labels = torch.tensor([0, 0, 0])
    nb = torch.tensor([[0, 2, -1], [0, 1, -1], [-1, -1, -1]])  # row 1: no other class, row 2: empty
    rows = class_conditional_loss(emb, labels, centres, centre_labels, nb, reduction="none")
    assert rows[1] == 0 and rows[2] == 0 and rows[0] > 0
    mean = class_conditional_loss(emb, labels, centres, centre_labels, nb)
    torch.testing.assert_close(mean, rows[0])
    mean.backward()
    assert torch.all(emb.grad[1:] == 0) and torch.isfinite(emb.grad).all()
    # All rows invalid: a zero loss, not NaN.
    z = class_conditional_loss(emb, labels, centres, centre_labels, nb[1:2].expand(3, -1))
    assert z == 0


def test_zero_weights_remove_centres():
    emb, labels, centres, centre_labels, nb = problem(seed=3)
    weights = torch.rand(centres.shape[0], dtype=torch.float64) + 0.5
    weights[::4] = 0
    out = class_conditional_loss(emb, labels, centres, centre_labels, nb, k=3, weights=weights,
                                 reduction="none")
    ref, _ = reference_rows(emb, labels, centres, centre_labels, nb, 3, math.sqrt(0.5),
                            weights=weights)
    torch.testing.assert_close(out, ref)


def test_chunked_over_rows(monkeypatch):
    emb, labels, centres, centre_labels, nb = problem(B=40, seed=4)
    e1 = emb.clone().requires_grad_(True)
    full = class_conditional_loss(e1, labels, centres, centre_labels, nb, k=3, reduction="none")
    full.sum().backward()
    monkeypatch.setattr(torch_path, "CHUNK_ELEMS", 60)  # ~1 row per chunk
    e2 = emb.clone().requires_grad_(True)
    c2 = centres.clone().requires_grad_(True)
    chunked = class_conditional_loss(e2, labels, c2, centre_labels, nb, k=3, reduction="none")
    chunked.sum().backward()
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(e2.grad, e1.grad)
    ref, _ = reference_rows(emb, labels, centres, centre_labels, nb, 3, math.sqrt(0.5))
    torch.testing.assert_close(chunked, ref)


def test_fp32_and_bf16_centres():
    emb, labels, centres, centre_labels, nb = problem(seed=5, dtype=torch.float32)
    out = class_conditional_loss(emb, labels, centres.bfloat16(), centre_labels, nb, k=2,
                                 reduction="none")
    assert out.dtype == torch.float32
    ref, _ = reference_rows(emb.double(), labels, centres.bfloat16().double(), centre_labels,
                            nb, 2, math.sqrt(0.5))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


def test_module_on_bank_matches_functional():
    emb, labels, centres, centre_labels, nb = problem(B=30, N=30, K=8, seed=6,
                                                      dtype=torch.float32)
    bank = CentreBank(centres, centre_labels, neighbours=nb)
    idx = torch.tensor([3, 7, 11, 0])
    x = emb[:4].clone().requires_grad_(True)
    y = centre_labels[idx]
    mod = ClassConditionalLoss(bank, k=2, sigma=1.0, objective="nll")
    loss = mod(x, y, idx)
    expect = class_conditional_loss(x, y, bank.centres, bank.centre_labels,
                                    bank.neighbours_for(idx, exclude_self=True), k=2,
                                    sigma=1.0, objective="nll")
    torch.testing.assert_close(loss, expect)
    loss.backward()
    assert x.grad is not None and mod.last_valid.shape == (4,)
    assert isinstance(mod, torch.nn.Module) and nnkloss.ClassConditionalLoss is ClassConditionalLoss


def test_validation_errors():
    emb, labels, centres, centre_labels, nb = problem()
    with pytest.raises(ValueError, match="k must"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb, k=0)
    with pytest.raises(ValueError, match="objective"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb, objective="hinge")
    with pytest.raises(ValueError, match="reduction"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb, reduction="max")
    with pytest.raises(ValueError, match="sigma"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb, sigma=0.0)
    with pytest.raises(IndexError, match="neighbours"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb + 100)
    with pytest.raises(ValueError, match="labels"):
        class_conditional_loss(emb, labels[:3], centres, centre_labels, nb)
    with pytest.raises(TypeError, match="bank"):
        ClassConditionalLoss(centres)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gathered_nonfinite_centre_is_refused_before_the_loss(value, dtype):
    """CCML keeps the check of the gathered centres before the loss, on the CPU too (the Eq. 3
    op checks them after, from its NaN rows). With the checks off, every row that lists the
    NaN/inf centre is NaN and counted, although its nearest-entry selection (k=1) would have
    left the centre out of its means (it did, silently, before this was fixed)."""
    emb, labels, centres, centre_labels, nb = problem()
    centres = centres.to(dtype)
    j = int(nb[1, 0])
    centres[j, 0] = value
    with nnkloss.value_checks(False):
        rows, counted = nnkloss.losses.ccml.class_conditional_loss_rows(
            emb, labels, centres, centre_labels, nb, k=1)
    gathered_by = (nb == j).any(1)
    assert torch.isnan(rows[gathered_by]).all() and counted[gathered_by].all()
    assert torch.isfinite(rows[~gathered_by]).all()
    with pytest.raises(ValueError, match=r"^centres contain NaN or inf in rows that neighbours "
                       r"gathers$"):
        class_conditional_loss(emb, labels, centres, centre_labels, nb, k=1)
    # A non-finite centre that no list gathers is not read, and not an error.
    unused = problem()[2].to(dtype)
    unused[j] = value
    assert torch.isfinite(class_conditional_loss(emb, labels, unused, centre_labels,
                                                 nb.masked_fill(nb == j, -1), k=1))


def test_ccml_sigma_is_stored_and_read_as_the_kernel_loss_does():
    """ClassConditionalLoss keeps sigma as the Parameter log_sigma like NeighbourKernelLoss;
    kernel_sigma() reads a float, a learned sigma gets a gradient, bad sigma is refused by the
    package's one sigma check (same message as the kernel loss)."""
    g = torch.Generator().manual_seed(0)
    bank = CentreBank(torch.randn(12, 3, generator=g), torch.arange(12) % 3)
    bank.rebuild_neighbours(6, search_backend="torch")
    fixed = ClassConditionalLoss(bank, k=2, sigma=0.9)
    assert not fixed.log_sigma.requires_grad and fixed.kernel_sigma() == pytest.approx(0.9)
    assert not hasattr(fixed, "sigma") and fixed.log_values() == {"sigma": fixed.kernel_sigma()}
    learned = ClassConditionalLoss(bank, k=2, sigma=0.9, learn_sigma=True)
    idx = torch.arange(12)
    emb = bank.centres[idx] + 0.3 * torch.randn(12, 3, generator=g)
    learned(emb, bank.centre_labels[idx], idx).backward()
    assert learned.log_sigma.grad is not None and learned.log_sigma.grad != 0
    # The same value as a float sigma of the functional form (sigma read back through exp).
    expected = class_conditional_loss(emb, bank.centre_labels, bank.centres, bank.centre_labels,
                                      bank.neighbours_for(idx, True), k=2,
                                      sigma=learned.sigma_tensor().detach())
    torch.testing.assert_close(fixed(emb, bank.centre_labels[idx], idx), expected)
    for bad in (0.0, -1.0, float("nan")):
        for make in (lambda s: ClassConditionalLoss(bank, sigma=s),
                     lambda s: nnkloss.NeighbourKernelLoss(bank, sigma=s)):
            with pytest.raises(ValueError, match=r"^sigma must be positive and finite"):
                make(bad)


def test_ccml_declares_its_parameter_groups():
    bank = CentreBank(torch.randn(8, 3), torch.arange(8) % 2, learn_weights=True)
    loss = ClassConditionalLoss(bank, k=2, learn_sigma=True)
    groups = loss.parameter_groups()
    assert groups == {"sigma": [loss.log_sigma], "weights": [bank.log_weights], "other": []}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selection_distances_are_the_fused_forwards(monkeypatch, dtype):
    """The (B, K) distances that choose each row's entries come from the Eq. 3 op's forward at
    sigma 1, forward-only (on CPU tensors the compiled library: one pass, no (rows, K, D)
    block): ||x - c_j||^2 for every entry, 0 for padding, to the compute dtype's precision."""
    from nnkloss.losses import ccml
    from nnkloss import cpu
    emb, labels, centres, centre_labels, nb = problem(B=9, N=40, D=13, K=11, seed=7,
                                                      dtype=dtype)
    calls = []
    real = cpu.forward

    def spy(*a, **kw):
        bound = inspect.signature(real).bind(*a, **kw)
        bound.apply_defaults()
        calls.append((bound.arguments["store_dist"], bound.arguments["need_grad_x"]))
        return real(*a, **kw)
    monkeypatch.setattr(nnkloss.ops.neighbour_kernel.by_name("cpu"), "forward", spy)
    d = ccml._list_distances(emb, labels, centres, centre_labels, nb, None)
    assert calls == [(True, False)]
    want = ((centres[nb.clamp_min(0)].double() - emb[:, None, :].double()) ** 2).sum(-1)
    want = want.masked_fill(nb < 0, 0.0)
    assert d.dtype == dtype and d.shape == nb.shape
    torch.testing.assert_close(d.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=0)
    calls.clear()
    class_conditional_loss(emb, labels, centres, centre_labels, nb, k=3)
    assert calls == [(True, False)]


def test_no_block_with_a_list_axis_and_a_d_axis():
    """Neither the selection nor the means build a (rows, K, D) or (rows, k, D) tensor:
    every tensor an op returns in forward and backward is recorded and none is 3-D."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.seen.append((str(func), tuple(t.shape)))
            return out

    emb, labels, centres, centre_labels, nb = problem(B=7, N=40, D=6, K=9, seed=11,
                                                      dtype=torch.float32)
    e = emb.clone().requires_grad_(True)
    c = centres.clone().requires_grad_(True)
    with Shapes() as mode:
        class_conditional_loss(e, labels, c, centre_labels, nb, k=4).backward()
    assert e.grad is not None and c.grad is not None
    assert mode.seen, "the mode saw no op"
    assert [s for s in mode.seen if len(s[1]) >= 3] == []


def test_an_unlisted_nonfinite_centre_stays_out_of_short_rows():
    """A row with fewer than k entries on a side stands in centre 0 for the missing ones; a
    NaN in centre 0 that no list gathers (so no check refuses it) must not reach the loss or
    the gradients."""
    emb, labels, centres, centre_labels, nb = problem(B=8, N=30, D=4, K=6, seed=12)
    nb = torch.where(nb == 0, torch.ones_like(nb), nb)  # no list gathers centre 0
    centres = centres.clone()
    centres[0] = float("nan")
    e = emb.clone().requires_grad_(True)
    c = centres.clone().requires_grad_(True)
    out = class_conditional_loss(e, labels, c, centre_labels, nb, k=5, reduction="none")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(e.grad).all()
    assert torch.isfinite(c.grad[1:]).all() and (c.grad[0] == 0).all()
    ref, _ = reference_rows(emb, labels, centres, centre_labels, nb, 5, math.sqrt(0.5))
    torch.testing.assert_close(out.detach(), ref)


@pytest.mark.parametrize("objective", ["accuracy", "nll"])
def test_a_distance_beyond_the_compute_dtype_makes_its_row_nan(objective):
    """A finite embedding whose squared distance to a list entry overflows fp32 (|x| ~ 1e20)
    cannot be ranked (an inf distance read as "no entry"): its row is NaN and counted, so the
    mean is NaN, as the Eq. 3 loss has it (ops/CONTRACT.md rule 6); it used to come out 0 and
    be left out of the mean silently. The other rows and their gradients are unchanged."""
    emb, labels, centres, centre_labels, nb = problem(dtype=torch.float32)
    big = emb.clone()
    big[2] = 1e20
    e = big.clone().requires_grad_(True)
    rows, counted = nnkloss.losses.ccml.class_conditional_loss_rows(
        e, labels, centres, centre_labels, nb, k=3, objective=objective)
    assert torch.isnan(rows[2]) and counted[2]
    assert torch.isnan(class_conditional_loss(big, labels, centres, centre_labels, nb, k=3,
                                              objective=objective))
    keep = torch.arange(emb.shape[0]) != 2
    ref, ref_counted = reference_rows(emb.double(), labels, centres.double(), centre_labels, nb,
                                      3, math.sqrt(0.5), objective=objective)
    torch.testing.assert_close(rows[keep].double(), ref[keep], rtol=1e-5, atol=1e-6)
    assert torch.equal(counted[keep], ref_counted[keep])
    rows[keep].sum().backward()
    assert torch.isfinite(e.grad).all() and (e.grad[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint8])
def test_labels_of_any_integer_dtype(dtype):
    """Labels of any integer dtype, against int64 centre labels, give the int64 rows (torch's
    comparison refused to promote uint32 against int64, naming no argument)."""
    emb, labels, centres, centre_labels, nb = problem()
    want = class_conditional_loss(emb, labels, centres, centre_labels, nb, k=3, reduction="none")
    got = class_conditional_loss(emb, labels.to(dtype), centres, centre_labels, nb, k=3,
                                 reduction="none")
    torch.testing.assert_close(got, want)
