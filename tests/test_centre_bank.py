"""nnkloss/bank/centre_bank.py: CentreBank (its checks and their messages, index and label widths,
weights, state_dict loading, growth, neighbour lists)."""
import pytest
import torch

import nnkloss


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
