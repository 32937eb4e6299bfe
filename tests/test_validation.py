"""nnkloss/validation.py: every bad input of the functional op raises an exception that says what
is wrong; the value-check switch; one sigma check for every entry point."""
import pytest
import torch

import nnkloss
from cases import good_op_args as good


def test_good_input_works():
    assert torch.isfinite(nnkloss.neighbour_kernel_loss(**good()))


CASES = [
    ("emb", torch.randn(4), ValueError, "emb must be 2-D"),
    ("emb", torch.zeros(4, 3, dtype=torch.long), TypeError, "emb must have dtype"),
    ("emb", torch.full((4, 3), float("nan")), ValueError, "emb contains NaN"),
    ("labels", torch.tensor([0, 1, 0]), ValueError, "labels has length 3"),
    ("labels", torch.tensor([0.0, 1.0, 0.0, 1.0]), TypeError, "labels must have an integer"),
    ("labels", torch.tensor([True, False, True, False]), TypeError, "labels must have an integer"),
    ("centres", torch.randn(6, 4), ValueError, "centres have dimension 4"),
    ("centres", torch.randn(6, 3, 1), ValueError, "centres must be 2-D"),
    ("centre_labels", torch.tensor([0, 1]), ValueError, "centre_labels has length 2"),
    ("centre_labels", torch.zeros(6), TypeError, "centre_labels must have an integer"),
    ("neighbours", torch.tensor([[0, 1], [2, 3], [4, 5], [1, 6]]), IndexError, "index 6"),
    ("neighbours", torch.tensor([[0, 1], [2, 3], [4, 5], [1, -2]]), IndexError, "-2"),
    ("neighbours", torch.zeros(4, 2), TypeError, "neighbours must have an integer"),
    ("neighbours", torch.zeros(4, 2, dtype=torch.int16), TypeError, "int32 or int64"),
    ("neighbours", torch.zeros(3, 2, dtype=torch.long), ValueError, "neighbours has 3 rows"),
    ("neighbours", torch.zeros(4, 0, dtype=torch.long), ValueError, "at least one column"),
    ("weights", -torch.ones(6), ValueError, "non-negative"),
    ("weights", torch.ones(5), ValueError, "weights has length 5"),
    ("weights", torch.full((6,), float("inf")), ValueError, "finite"),
    ("sigma", 0.0, ValueError, "sigma must be positive"),
    ("sigma", -1.0, ValueError, "sigma must be positive"),
    ("sigma", float("nan"), ValueError, "sigma must be positive"),
    ("sigma", torch.tensor(-2.0), ValueError, "sigma must be positive"),
    ("sigma", torch.tensor([1.0, 2.0]), ValueError, "sigma must be a float or a 0-dim"),
    ("sigma", "wide", TypeError, "sigma must be a float"),
    ("reduction", "avg", ValueError, "reduction must be one of"),
    ("backend", "cuda", ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("name, value, exc, match", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_raises(name, value, exc, match):
    args = good()
    args[name] = value
    with pytest.raises(exc, match=match):
        nnkloss.neighbour_kernel_loss(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_mixed_devices():
    args = good()
    args["centres"] = args["centres"].cuda()
    with pytest.raises(ValueError, match="centres is on cuda"):
        nnkloss.neighbour_kernel_loss(**args)


def test_mixed_devices_meta():
    """A second device without a GPU: the meta device."""
    args = good()
    args["centre_labels"] = args["centre_labels"].to("meta")
    with pytest.raises(ValueError, match="centre_labels is on meta"):
        nnkloss.neighbour_kernel_loss(**args)


def test_value_checks_can_be_disabled_for_hot_loops():
    args = good()
    args["weights"] = -torch.ones(6)
    with nnkloss.value_checks(False):
        nnkloss.neighbour_kernel_loss(**args)  # no validation: the caller vouches for the data
    with pytest.raises(ValueError):
        nnkloss.neighbour_kernel_loss(**args)


def test_value_checks_has_one_public_switch():
    """nnkloss.value_checks(enabled) is the only public way: a context manager that restores
    the previous setting, exceptions included; the old setter is gone."""
    from nnkloss.validation import value_checks_enabled
    assert not hasattr(nnkloss, "set_value_checks") and "set_value_checks" not in nnkloss.__all__
    assert value_checks_enabled()
    bad = dict(good(), neighbours=torch.tensor([[0, 1], [2, 3], [4, 5], [1, 6]]))
    with nnkloss.value_checks(False):
        assert not value_checks_enabled()
        with nnkloss.value_checks(True):
            with pytest.raises(IndexError):
                nnkloss.neighbour_kernel_loss(**bad)
        assert not value_checks_enabled()
    assert value_checks_enabled()
    with pytest.raises(RuntimeError):
        with nnkloss.value_checks(False):
            raise RuntimeError("boom")
    assert value_checks_enabled()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with nnkloss.value_checks(0):
            pass


@pytest.mark.parametrize("bad, exc, msg", [
    (0.0, ValueError, "positive and finite"), (float("inf"), ValueError, "positive and finite"),
    (True, TypeError, "must be a float"), ("1", TypeError, "must be a float"),
    (torch.tensor([1.0, 2.0]), ValueError, "0-dim"), (torch.tensor(2), TypeError, "floating"),
], ids=["zero", "inf", "bool", "str", "vector", "int-tensor"])
def test_one_sigma_check_everywhere(bad, exc, msg):
    """Every entry point that takes a sigma value refuses bad ones with the same message, from
    nnkloss.validation.require_sigma."""
    from nnkloss.bank.refresh import _check_sigma
    from nnkloss.validation import require_sigma
    bank = nnkloss.CentreBank(torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1]))
    calls = [require_sigma, _check_sigma,
             lambda s: nnkloss.NeighbourKernelLoss(bank, sigma=s),
             lambda s: nnkloss.ClassConditionalLoss(bank, sigma=s),
             lambda s: nnkloss.NeighbourKernelClassifier(bank, k=2, sigma=s)]
    for call in calls:
        with pytest.raises(exc, match=r"^sigma " + ".*" + msg):
            call(bad)
