"""nnkloss/bank/centre_bank.py: CentreBank (its checks and their messages, index and label widths,
weights, state_dict loading, growth, neighbour lists)."""
import warnings

import pytest
import torch

import nnkloss
from cases import nonuniform, own_row_bank as make_bank, random_bank


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_bank_index_and_label_widths_at_the_int32_boundary():
    """Kills centre_bank._index_dtype 2-6 and _compact_labels 4-13: int32 exactly while the
    values fit, int64 from 2**31 (and below -2**31) on."""
    from nnkloss.bank.centre_bank import _compact_labels, _index_dtype
    assert _index_dtype(2 ** 31 - 1) == torch.int32 and _index_dtype(2 ** 31) == torch.int64
    assert _compact_labels(torch.tensor([0, 2 ** 31 - 1])).dtype == torch.int32
    assert _compact_labels(torch.tensor([0, 2 ** 31])).dtype == torch.int64
    assert _compact_labels(torch.tensor([-2 ** 31, 5])).dtype == torch.int32
    assert _compact_labels(torch.tensor([-2 ** 31 - 1, 5])).dtype == torch.int64
    assert _compact_labels(torch.empty(0, dtype=torch.long)).dtype == torch.int32
    assert torch.equal(_compact_labels(torch.tensor([3, 2 ** 40])), torch.tensor([3, 2 ** 40]))


def test_log_weight_validation_names_what_is_wrong():
    """Kills centre_bank._validate_log_weights 1-3, 12, 13, 28, 29: the default name, the
    length message, the NaN / +inf and the learned -inf messages. (20 and 26, ``float("INF")``
    for ``float("inf")``, are equivalent: Python parses both.)"""
    from nnkloss.bank.centre_bank import _validate_log_weights
    with pytest.raises(ValueError, match=r"^log_weights has length 2 but the bank has 3 centres$"):
        _validate_log_weights(torch.zeros(2), 3, learned=False)
    with pytest.raises(ValueError, match=r"^log_weights contain NaN or \+inf: weights must be "
                                         r"finite and non-negative$"):
        _validate_log_weights(torch.tensor([0.0, float("inf")]), 2, learned=False)
    with pytest.raises(ValueError, match=r"^w hold zero weights \(-inf\), but learned weights "
                                         r"must be strictly positive$"):
        _validate_log_weights(torch.tensor([0.0, -float("inf")]), 2, learned=True, name="w")
    ok = torch.tensor([0.0, -float("inf")])
    assert _validate_log_weights(ok, 2, learned=False) is ok
    # 3 (found by the re-run): the shape / dtype checks name the argument too
    with pytest.raises(ValueError, match=r"^log_weights must be 1-D, got shape \(3, 1\)$"):
        _validate_log_weights(torch.zeros(3, 1), 3, learned=False)
    with pytest.raises(TypeError, match=r"^log_weights must have dtype in .*got torch.int64$"):
        _validate_log_weights(torch.zeros(3, dtype=torch.int64), 3, learned=False)


def test_bank_log_weights_are_fp32_whatever_the_default_dtype():
    """Kills centre_bank CentreBank.__init__ 65, 68 (``dtype=torch.float32`` of the uniform
    log-weights dropped): under ``torch.set_default_dtype(torch.float64)`` they became fp64,
    which the contract's fp32 weight vector does not allow for."""
    from nnkloss.bank.centre_bank import CentreBank
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        bank = CentreBank(torch.zeros(3, 2, dtype=torch.float32), torch.tensor([0, 1, 0]))
    finally:
        torch.set_default_dtype(old)
    assert bank.log_weights.dtype == torch.float32
    assert torch.equal(bank.weights, torch.ones(3))


def test_load_state_dict_applies_the_learned_rule_and_names_the_full_key():
    """Kills centre_bank CentreBank._load_from_state_dict 36 (``learned=None``: a learned bank
    accepted zero weights from a state dict) and 41 (the key's prefix dropped from the error)."""
    from nnkloss.bank.centre_bank import CentreBank

    def loss(learn):
        bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 0]), learn_weights=learn)
        return nnkloss.NeighbourKernelLoss(bank)

    sd = loss(True).state_dict()
    sd["bank.log_weights"] = torch.tensor([0.0, -float("inf"), 0.0])
    with pytest.raises(ValueError, match=r"^bank\.log_weights hold zero weights \(-inf\)"):
        loss(True).load_state_dict(sd)
    fixed = loss(False)
    fixed.load_state_dict(sd)  # a fixed bank may hold a zero weight
    assert torch.equal(fixed.bank.weights, torch.tensor([1.0, 0.0, 1.0]))
    sd["bank.log_weights"] = torch.tensor([0.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match=r"^bank\.log_weights contain NaN"):
        fixed.load_state_dict(sd)


def test_load_state_dict_reports_a_bad_entry_as_a_load_error():
    """Kills centre_bank CentreBank._load_from_state_dict 58 (``error_msgs`` not passed on: an
    entry that is not a tensor ended in an AttributeError on None instead of PyTorch's load
    error naming the entry)."""
    from nnkloss.bank.centre_bank import CentreBank
    bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 0]))
    sd = bank.state_dict()
    sd["centres"] = sd["centres"].numpy()
    with pytest.raises(RuntimeError, match=r'(?s)Error\(s\) in loading state_dict for CentreBank.*'
                                           r'"centres"'):
        bank.load_state_dict(sd)


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_bank.py (issue 14 README promises; issue 19).
def test_load_state_dict_restores_fixed_nonuniform_weights():
    src = nnkloss.NeighbourKernelLoss(random_bank(weights=nonuniform(30)), sigma=1.3)
    dst = nnkloss.NeighbourKernelLoss(random_bank(), sigma=1.3)  # same size, uniform weights
    assert dst.bank.weights_for_loss() is None
    idx = torch.arange(0, 30, 3)
    emb = torch.randn(len(idx), 6, generator=torch.Generator().manual_seed(2))
    labels = src.bank.centre_labels[idx]
    want = src(emb, labels, idx)
    assert not torch.allclose(want, dst(emb, labels, idx))  # the weights matter here
    dst.load_state_dict(src.state_dict())
    assert not dst.bank.learn_weights
    torch.testing.assert_close(dst.bank.weights_for_loss(), nonuniform(30))
    torch.testing.assert_close(dst(emb, labels, idx), want)
    # ... and back: uniform weights loaded into a weighted bank make it uniform again.
    src.load_state_dict(nnkloss.NeighbourKernelLoss(random_bank(), sigma=1.3).state_dict())
    assert src.bank.weights_for_loss() is None
    uniform = nnkloss.NeighbourKernelLoss(random_bank(), sigma=1.3)
    torch.testing.assert_close(src(emb, labels, idx), uniform(emb, labels, idx))


def test_growing_a_learned_bank_keeps_the_parameter_in_a_user_optimiser():
    bank = random_bank(N=20, K=5, learn_weights=True)
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
    fn(emb, bank.centre_labels, idx).backward()
    opt.step()
    moved = bank.log_weights.detach() != before
    assert moved[:20].any() and moved[20:].any()  # old and new weights both train


def test_growing_a_learned_bank_with_given_weights_keeps_the_parameter():
    bank = random_bank(N=10, K=3, learn_weights=True)
    param = bank.log_weights
    bank.add(torch.randn(2, 6), torch.tensor([0, 1]), weights=torch.tensor([2.0, 0.5]))
    assert bank.log_weights is param and bank.log_weights.requires_grad
    torch.testing.assert_close(bank.weights.detach()[10:], torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(bank.weights.detach()[:10], torch.ones(10))


# The tests below kill mutants of bank.py that survived Trial 1 (tests/MUTATION.md).
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
    with pytest.raises(TypeError, match=r"^centre_labels must"):
        nnkloss.CentreBank(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(ValueError, match=r"^centres contain NaN or inf$"):
        nnkloss.CentreBank(torch.full((4, 2), float("inf")), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^centre_labels are on meta but centres on cpu$"):
        nnkloss.CentreBank(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long, device="meta"))


def test_neighbours_for_errors_and_empty_idx():
    bank = random_bank(N=10, K=3)
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
        assert torch.equal(bank.centres, c) and torch.equal(bank.centre_labels, l)
    default = nnkloss.CentreBank.from_class_means(emb, labels, per_class=3)
    assert torch.equal(default.centres, class_centroids(emb, labels, per_class=3, seed=0)[0])
    assert not torch.equal(class_centroids(emb, labels, per_class=3, seed=0)[0],
                           class_centroids(emb, labels, per_class=3, seed=3)[0])


def test_bank_load_state_dict_strictness():
    bank = random_bank(N=8, K=2)
    sd = bank.state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        random_bank(N=8, K=2).load_state_dict({**sd, "bogus": torch.zeros(1)})
    partial = {k: v for k, v in sd.items() if k != "log_weights"}
    with pytest.raises(RuntimeError, match="Missing key"):
        random_bank(N=8, K=2).load_state_dict(partial)
    other = random_bank(N=8, K=2, weights=nonuniform(8))
    other.load_state_dict(partial, strict=False)  # weights kept, nothing else breaks
    torch.testing.assert_close(other.weights_for_loss(), nonuniform(8))
    assert torch.equal(other.centres, bank.centres)


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_module.py (CentreBank and NeighbourKernelLoss; now tests/test_losses.py)
# in issue 19.
def test_exclusion_also_when_self_appears_twice():
    bank = make_bank(N=10, K=4)
    bank.set_neighbours(torch.stack([torch.tensor([i, i, (i + 1) % 10, (i + 2) % 10])
                                     for i in range(10)]))
    idx = torch.tensor([4])
    assert bank.neighbours_for(idx).tolist() == [[-1, -1, 5, 6]]


def test_bank_stores_int32_lists_and_labels_and_keeps_them_through_updates():
    bank = make_bank()
    assert bank.centre_labels.dtype == bank.neighbours.dtype == torch.int32
    bank.update_(centre_labels=bank.centre_labels.long(), neighbours=bank.neighbours.long())
    assert bank.centre_labels.dtype == bank.neighbours.dtype == torch.int32
    big = nnkloss.CentreBank(torch.zeros(2, 3), torch.tensor([0, 2 ** 40]))
    assert big.centre_labels.dtype == torch.int64 and int(big.centre_labels[1]) == 2 ** 40


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


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(5, dtype=torch.long)), ValueError,
     "centre_labels has length 5"),
    (dict(centres=torch.randn(4, 3), centre_labels=torch.zeros(4)), TypeError,
     "^centre_labels must"),
    (dict(centres=torch.randn(4), centre_labels=torch.zeros(4, dtype=torch.long)), ValueError, "centres"),
    (dict(centres=torch.full((4, 3), float("nan")), centre_labels=torch.zeros(4, dtype=torch.long)),
     ValueError, "NaN"),
    (dict(centres=torch.randn(4, 0), centre_labels=torch.zeros(4, dtype=torch.long)), ValueError,
     r"^centres must have at least one column \(D >= 1\)$"),
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


def test_centres_that_share_memory_are_refused_where_given():
    # An expand()-ed bank was accepted, and the first write_centres_ failed mid-training
    # (torch refuses in-place writes into overlapping memory).
    labels = torch.zeros(5, dtype=torch.long)
    row = torch.randn(1, 6)
    for shared in (row.expand(5, 6), torch.randn(10)[:6].as_strided((5, 6), (1, 1))):
        with pytest.raises(ValueError, match=r"centres overlap in memory.*centres\.clone\(\)"):
            nnkloss.CentreBank(shared, labels)
    bank = nnkloss.CentreBank(torch.randn(5, 6), labels)
    before = bank.centres.clone()
    with pytest.raises(ValueError, match="centres overlap in memory"):
        bank.update_(centres=row.expand(5, 6))
    assert torch.equal(bank.centres, before)  # nothing changed
    # The clone the error asks for trains; so do views that own their elements (a transpose,
    # a column slice, a step), still kept, not copied.
    bank = nnkloss.CentreBank(row.expand(5, 6).clone(), labels)
    bank.write_centres_(torch.tensor([2]), torch.ones(1, 6))
    assert torch.equal(bank.centres[2], torch.ones(6))
    for view in (torch.randn(6, 5).t(), torch.randn(5, 12)[:, :6], torch.randn(5, 12)[:, ::2],
                 torch.randn(1, 6).expand(1, 6)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # not contiguous: test_strided_centres_warn
            bank = nnkloss.CentreBank(view, torch.zeros(view.shape[0], dtype=torch.long))
        bank.write_centres_(torch.tensor([0]), torch.full((1, 6), 3.0))
        assert torch.equal(view[0], torch.full((6,), 3.0))  # the owner sees the write


def test_strided_centres_warn_that_every_call_copies_them():
    """A bank kept as a non-contiguous view works, but each loss call copies all of it: the
    constructor and update_ say so once, naming the fix; contiguous centres pass silently."""
    labels = torch.zeros(5, dtype=torch.long)
    for strided in (torch.randn(6, 5).t(), torch.randn(5, 12)[:, :6]):
        with pytest.warns(UserWarning, match=r"centres are not contiguous.*copy the whole "
                                             r"bank.*centres\.contiguous\(\)"):
            bank = nnkloss.CentreBank(strided, labels)
        with pytest.warns(UserWarning, match="centres are not contiguous"):
            bank.update_(centres=strided)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bank = nnkloss.CentreBank(torch.randn(5, 6), labels)
        bank.update_(centres=torch.randn(5, 6))
        nnkloss.CentreBank(torch.randn(1, 6).expand(1, 6), labels[:1])  # one row: contiguous
        nnkloss.CentreBank(torch.randn(0, 6), labels[:0])


# ---------------------------------------------------------------------------------------------
# CentreBank.rebuild_neighbours (moved from tests/test_refresh.py; issue 19).
from nnkloss import CentreBank  # noqa: E402
from nnkloss.bank.search import faiss_available, neighbour_lists  # noqa: E402

BACKENDS = ["torch", pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(),
                                                                      reason="needs faiss"))]


def brute_lists(centres, k):
    rows = []
    for i in range(centres.shape[0]):
        d = (centres.double() - centres[i].double()).pow(2).sum(1)
        d[i] = float("inf")
        rows.append(d.sort().values[:k])
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rebuild_neighbours_matches_brute_force(backend):
    g = torch.Generator().manual_seed(0)
    bank = CentreBank(torch.randn(80, 5, generator=g), torch.randint(0, 4, (80,), generator=g))
    lists = bank.rebuild_neighbours(7, search_backend=backend)
    assert bank.neighbours.shape == (80, 7) and torch.equal(bank.neighbours, lists.neighbours)
    assert (lists.neighbours != torch.arange(80)[:, None]).all()
    torch.testing.assert_close(lists.distances.double(), brute_lists(bank.centres, 7),
                               rtol=1e-4, atol=1e-4)
    same = bank.centre_labels[lists.neighbours] == bank.centre_labels[:, None]
    assert torch.equal(lists.has_positive, same.any(1))
    assert lists.num_patched == 0 and lists.seconds >= 0 and lists.search_backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_rebuild_neighbours_ensure_positive(backend):
    g = torch.Generator().manual_seed(1)
    n, k = 120, 3
    centres = torch.randn(n, 4, generator=g)
    labels = torch.randint(0, 12, (n,), generator=g)  # geometry ignores labels: few positives
    labels[7] = 99  # a class of one: nothing can be patched in
    bank = CentreBank(centres, labels)
    plain = neighbour_lists(centres, labels, k, search_backend=backend)
    lists = bank.rebuild_neighbours(k, search_backend=backend, ensure_positive=True)
    lacking = ~plain.has_positive
    assert lacking.sum() > 10  # the test data does exercise the patching
    assert lists.num_patched == int(lacking.sum()) - 1
    assert not bool(lists.has_positive[7]) and torch.equal(lists.neighbours[7], plain.neighbours[7])
    assert lists.has_positive.sum() == n - 1
    # Rows that had a positive are untouched; the others keep their first k-1 entries and end
    # with their nearest same-label centre (brute force, one row at a time).
    assert torch.equal(lists.neighbours[~lacking], plain.neighbours[~lacking])
    assert torch.equal(lists.neighbours[:, :-1], plain.neighbours[:, :-1])
    for i in lacking.nonzero().flatten().tolist():
        if i == 7:
            continue
        j = int(lists.neighbours[i, -1])
        assert j != i and labels[j] == labels[i]
        same = (labels == labels[i]).nonzero().flatten()
        same = same[same != i]
        d_same = (centres[same] - centres[i]).pow(2).sum(1)
        assert float(lists.distances[i, -1]) == pytest.approx(float(d_same.min()), rel=1e-4,
                                                               abs=1e-5)
    assert (lists.distances[:, 1:] >= lists.distances[:, :-1]).all()
    assert torch.equal(bank.neighbours, lists.neighbours)


def test_rebuild_neighbours_errors_leave_lists():
    bank = CentreBank(torch.randn(5, 2), torch.arange(5))
    bank.rebuild_neighbours(2, search_backend="torch")
    before = bank.neighbours.clone()
    with pytest.raises(ValueError, match="k=5"):
        bank.rebuild_neighbours(5, search_backend="torch")
    assert torch.equal(bank.neighbours, before)


def test_rebuild_neighbours_takes_the_symmetric_search(symmetric_tiles):
    """The bank searches its centres against themselves as ONE tensor, so on the CPU with the
    compiled selection the symmetric self-search runs (each pair's distance computed once);
    on exactly representable centres its lists equal the blockwise path's (issue 21)."""
    from nnkloss.bank.search import knn
    calls = symmetric_tiles
    g = torch.Generator().manual_seed(5)
    bank = CentreBank(torch.randint(0, 4, (100, 3), generator=g).float(),
                      torch.randint(0, 5, (100,), generator=g))
    lists = bank.rebuild_neighbours(9, search_backend="torch")
    assert calls == [(i, j) for i in range(0, 100, 32) for j in range(i, 100, 32)]
    ref = knn(bank.centres.clone(), bank.centres, 9, "torch", exclude_self=True)
    assert len(calls) == 10, "an equal copy must take the blockwise path"
    assert torch.equal(lists.neighbours, ref.neighbours)
    assert torch.equal(lists.distances, ref.distances)


@pytest.mark.parametrize("exclude_self", [True, False])
def test_neighbours_for_gives_the_same_lists_with_and_without_the_cpu_library(monkeypatch,
                                                                              exclude_self):
    """The compiled one-pass gather (CPU banks, eager) and torch's ops give equal lists; the
    range errors stay the bank's own."""
    from nnkloss import cpu
    bank = random_bank(N=40, K=6)
    bank.set_neighbours(torch.cat([torch.arange(40)[:, None], bank.neighbours[:, 1:].long()], 1))
    idx = torch.tensor([3, 0, 39, 3, 17])
    fast = bank.neighbours_for(idx, exclude_self)
    monkeypatch.setattr(cpu, "gather_lists", lambda *a: None)
    slow = bank.neighbours_for(idx, exclude_self)
    assert fast.dtype == slow.dtype and torch.equal(fast, slow)
    assert bool((fast[:, 0] == -1).all()) == exclude_self
    monkeypatch.undo()
    with pytest.raises(IndexError, match=r"^idx holds 40 but the bank has rows 0\.\.39$"):
        bank.neighbours_for(torch.tensor([1, 40]))


def test_check_rows_and_require_neighbours_name_what_is_wrong():
    """The two checks neighbours_for and a loss's one-launch lists share: idx outside the bank
    (IndexError naming idx and the bank's rows) and a bank without lists (RuntimeError)."""
    bank = nnkloss.CentreBank(torch.randn(5, 3), torch.zeros(5, dtype=torch.long),
                              neighbours=torch.zeros(5, 2, dtype=torch.long))
    bank.check_rows(torch.tensor([0, 4]))
    bank.check_rows(torch.zeros(0, dtype=torch.long))
    bank.require_neighbours()
    for bad, shown in ((torch.tensor([0, 5]), "5"), (torch.tensor([-1, 2]), "-1")):
        with pytest.raises(IndexError, match=rf"idx holds {shown} but the bank has rows 0\.\.4"):
            bank.check_rows(bad)
    empty = nnkloss.CentreBank(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no neighbour lists yet"):
        empty.require_neighbours()


def test_load_state_dict_checks_values_in_the_banks_dtypes():
    """A state dict is checked as the bank will store it (audit A): fp64 centres or log-weights
    of 1e300 (finite in the file) were copied into the fp32 bank as inf, fp32 1e38 into an fp16
    bank likewise, and a class id of 2**40 into the int32 labels wrapped around to 0."""
    from nnkloss.bank.centre_bank import CentreBank

    def bank(dtype=torch.float32):
        return CentreBank(torch.randn(4, 3).to(dtype), torch.tensor([0, 1, 0, 1]))

    for dtype, key, value in ((torch.float32, "centres", torch.full((4, 3), 1e300,
                                                                    dtype=torch.float64)),
                              (torch.float16, "centres", torch.full((4, 3), 1e38)),
                              (torch.float32, "log_weights", torch.full((4,), 1e300,
                                                                        dtype=torch.float64))):
        b = bank(dtype)
        before = {k: v.clone() for k, v in b.state_dict().items()}
        sd = {**b.state_dict(), key: value}
        with pytest.raises(ValueError, match=rf"^{key} contain NaN"):
            b.load_state_dict(sd)
        assert all(torch.equal(v, before[k]) for k, v in b.state_dict().items())
    b = bank()
    b.load_state_dict({**b.state_dict(), "centre_labels": torch.tensor([2 ** 40, 1, 0, 1])})
    assert b.centre_labels.tolist() == [2 ** 40, 1, 0, 1]
    # a resized bank keeps fp32 log-weights whatever the state dict's dtype
    b.load_state_dict({"centres": torch.zeros(5, 3), "centre_labels": torch.zeros(5, dtype=int),
                       "neighbours": torch.zeros(5, 0, dtype=int),
                       "log_weights": torch.zeros(5, dtype=torch.float64)})
    assert b.log_weights.dtype == torch.float32 and b.centre_labels.dtype == torch.int32


def test_wide_weights_are_checked_as_the_bank_stores_them():
    """fp64 weights are stored in fp32: one above fp32's range would be an infinite weight,
    a learnable one below it a zero weight (log -inf); both are refused, naming weights."""
    centres, labels = torch.zeros(4, 2), torch.tensor([0, 0, 1, 1])
    big = torch.tensor([1.0, 1e39, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^weights hold a value that overflows torch.float32 "
                                         r"\(max 1e\+39\)"):
        nnkloss.CentreBank(centres, labels, weights=big)
    bank = nnkloss.CentreBank(centres, labels)
    with pytest.raises(ValueError, match=r"^weights hold a value that overflows"):
        bank.update_(weights=big)
    tiny = torch.tensor([1.0, 1e-50, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^learnable weights must start strictly positive"):
        nnkloss.CentreBank(centres, labels, weights=tiny, learn_weights=True)
    assert nnkloss.CentreBank(centres, labels, weights=tiny).weights[1] == 0  # fixed: allowed
    assert torch.equal(bank.weights, torch.ones(4))


def test_log_weights_whose_weight_overflows_are_refused():
    """A finite log-weight whose exp overflows is an infinite weight (audit A): a checkpoint
    with a log-weight of 1000 loaded into a bank whose weights were inf."""
    from nnkloss.bank.centre_bank import CentreBank, _validate_log_weights
    with pytest.raises(ValueError, match=r"^lw hold a value whose weight exp\(lw\) overflows "
                                         r"torch.float32 \(max 1000.0\)"):
        _validate_log_weights(torch.tensor([0.0, 1000.0]), 2, learned=False, name="lw")
    ok = torch.tensor([0.0, 88.0, 100.0], dtype=torch.float64)  # exp(100) fits fp64
    assert _validate_log_weights(ok, 3, learned=True) is ok
    bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=r"^log_weights hold a value whose weight"):
        bank.load_state_dict({**bank.state_dict(), "log_weights": torch.tensor([0.0, 89.0, 0.0])})
    assert torch.equal(bank.weights, torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_narrow_integer_idx_names_the_same_rows_as_int64(dtype):
    """idx of any integer dtype names bank rows: torch's indexing reads a uint8 index as a
    boolean mask (other rows, silently: here rows 0..3 instead of row 1 four times) and refuses
    int8 / int16 with an error that names no argument."""
    bank = make_bank(N=4, K=3)
    idx = torch.ones(4, dtype=torch.long)
    want = bank.neighbours_for(idx)
    assert torch.equal(bank.neighbours_for(idx.to(dtype)), want)
    wrote = make_bank(N=4, K=3)
    wrote.write_centres_(torch.tensor([1], dtype=dtype), torch.ones(1, 6))
    expected = make_bank(N=4, K=3).centres.clone()
    expected[1] = 1.0
    torch.testing.assert_close(wrote.centres, expected, rtol=0, atol=0)


def test_update_checks_its_arguments_before_casting_them_to_the_bank():
    """update_ / set_neighbours check the tensors they are given, as the constructor does, not
    their casts to the bank's dtypes: an int64 index past 2**31 wrapped into the bank's range
    (2**32 + 3 became row 3), float or bool lists were truncated, integer centres were taken."""
    bank = random_bank(N=5, D=2, K=1)
    before = (bank.centres.clone(), bank.neighbours.clone())
    with pytest.raises(IndexError, match=r"^neighbours holds index 4294967299 but the bank has "
                       r"only 5 centres$"):
        bank.update_(neighbours=torch.full((5, 1), 2 ** 32 + 3))
    for bad in (torch.full((5, 1), 1.7), torch.ones(5, 1, dtype=torch.bool)):
        with pytest.raises(TypeError, match=r"^neighbours must have an integer dtype"):
            bank.set_neighbours(bad)
    with pytest.raises(TypeError, match=r"^centres must have dtype in"):
        bank.update_(centres=torch.ones(5, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"^centres must be a torch.Tensor, got list"):
        bank.update_(centres=[[1.0, 2.0]] * 5)
    with pytest.raises(TypeError, match=r"^centre_labels must be a torch.Tensor, got list"):
        bank.update_(centre_labels=[0] * 5)
    assert torch.equal(bank.centres, before[0]) and torch.equal(bank.neighbours, before[1])
    # int64 lists within range are still narrowed to the bank's index type
    assert bank.set_neighbours(torch.full((5, 1), 3)).neighbours.dtype == torch.int32
