"""nnkloss/validation.py: every bad input of the functional op raises an exception that says what
is wrong; the value-check switch; one sigma check for every entry point."""
import pytest
import torch

import nnkloss
from cases import good_op_args as good
from nnkloss.ops.backends import by_name

CPU = by_name("cpu")  # the backend whose one-pass reads the op hands the value checks


@pytest.fixture(params=["torch", "compiled"])
def checks_path(request, monkeypatch):
    """check_values by its torch reductions, or by the compiled CPU kernel's one call
    (nnkloss.cpu.value_flags, taken once the library is loaded: the CPU backend's, which
    the op hands the checks). Yields the list of the compiled calls made (True: taken); the
    compiled run asserts that each was taken."""
    from nnkloss import cpu
    from nnkloss.ops import backends
    if request.param == "torch":
        for name in ("value_flags", "gathered_rows_finite"):
            monkeypatch.setattr(backends.CpuBackend, name, lambda self, *a: None)
        yield None
        return
    if not cpu.available():
        pytest.skip("the compiled CPU kernel is unavailable here")
    taken = []
    real = cpu.value_flags

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(cpu, "value_flags", spy)
    yield taken
    assert all(taken)


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
def test_bad_input_raises(name, value, exc, match, checks_path):
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


# ------------------------------------------- the gathered centres: after the op on CPU tensors
GATHERED_MSG = r"^centres contain NaN or inf in rows that neighbours gathers$"


def value_args(centre=None, weight=None, emb=None):
    """check_values' arguments from good(), with centre 4 (gathered by row 2 only), weight 0
    or emb[0, 0] set to the given values."""
    a = good()
    if centre is not None:
        a["centres"][4, 0] = centre
    if weight is not None:
        a["weights"][0] = weight
    if emb is not None:
        a["emb"][0, 0] = emb
    return a["emb"], a["centres"], a["neighbours"], a["weights"], torch.tensor(1.0)


def test_check_values_defers_the_gathered_centres_only_when_asked_on_cpu(monkeypatch):
    from nnkloss import validation
    bad = value_args(centre=float("nan"))
    # Not asked (the CCML loss, which does not follow rule 6): checked here, as always.
    with pytest.raises(ValueError, match=GATHERED_MSG):
        validation.check_values(*bad)
    assert validation.check_values(*value_args()) is False
    # Asked, CPU tensors: not read here; True tells the caller to check after the op.
    assert validation.check_values(*bad, centres_after_op=True) is True
    with nnkloss.value_checks(False):
        assert validation.check_values(*bad, centres_after_op=True) is False
    monkeypatch.setattr(validation, "compiling", lambda: True)
    assert validation.check_values(*bad, centres_after_op=True) is False
    monkeypatch.setattr(validation, "compiling", lambda: False)
    # A device that does not defer (CUDA): checked here.
    monkeypatch.setattr(validation, "defers_gathered_centres", lambda device: False)
    with pytest.raises(ValueError, match=GATHERED_MSG):
        validation.check_values(*bad, centres_after_op=True)


@pytest.mark.parametrize("after", [False, True], ids=["before-op", "after-op"])
@pytest.mark.parametrize("case, exc, match", [
    (dict(centre=float("nan"), weight=-1.0), ValueError, GATHERED_MSG),
    (dict(centre=float("inf"), weight=float("nan")), ValueError, GATHERED_MSG),
    (dict(centre=float("nan"), emb=float("nan")), ValueError, r"^emb contains NaN or inf$"),
    (dict(weight=-1.0), ValueError, r"^weights must be finite and non-negative"),
], ids=["centres+negative-weight", "centres+nan-weight", "emb+centres", "weights"])
def test_errors_keep_their_order_when_the_centres_are_deferred(after, case, exc, match,
                                                              checks_path):
    """Several bad arguments: the same one is named with or without the deferral (the index
    range, then emb, sigma, centres, weights), so the deferral changes no error."""
    from nnkloss.validation import check_values
    with pytest.raises(exc, match=match):
        check_values(*value_args(**case), centres_after_op=after, fused=CPU)
    assert checks_path is None or checks_path == [True]


def test_check_after_the_op_reads_the_centres_only_for_a_nan_row(monkeypatch):
    from nnkloss import validation
    emb, centres, nb, _, _ = value_args()
    reads = []
    real = validation._gathered_rows_finite

    def counted(*args):
        reads.append(1)
        return real(*args)
    monkeypatch.setattr(validation, "_gathered_rows_finite", counted)
    finite_rows = torch.zeros(4)
    validation.check_gathered_centres_after_op(finite_rows, centres, nb)
    assert reads == []  # one reduction of B numbers, no centre read
    nan_row = torch.tensor([0.0, 0.0, float("nan"), 0.0])
    validation.check_gathered_centres_after_op(nan_row, centres, nb)  # finite centres: no error
    assert reads == [1]
    centres[4, 0] = float("nan")
    with pytest.raises(ValueError, match=GATHERED_MSG):
        validation.check_gathered_centres_after_op(nan_row, centres, nb)
    # A row NaN for another reason, and the bad centre dropped from the lists: not read.
    validation.check_gathered_centres_after_op(nan_row, centres, nb.masked_fill(nb == 4, -1))
    # The reduced loss stands for its rows (a NaN row makes the sum and the mean NaN): a
    # finite one reads no centre, a NaN one reads them and names the bad centres.
    reads.clear()
    for reduced in (finite_rows.sum(), finite_rows.mean(), torch.tensor(float("inf"))):
        validation.check_gathered_centres_after_op(reduced, centres, nb)
    assert reads == []
    for reduced in (nan_row.sum(), nan_row.mean()):
        with pytest.raises(ValueError, match=GATHERED_MSG):
            validation.check_gathered_centres_after_op(reduced, centres, nb)
    assert reads == [1, 1]


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
def test_checked_op_does_not_gather_the_centres_when_every_row_is_finite(monkeypatch, backend):
    """The B x K x D read of the gathered centres ran on every checked call (~20x the op on the
    CPU); now it runs only to explain a NaN row. Fails on the old code, which always read."""
    from nnkloss import validation

    def no_read(*args):
        raise AssertionError("the gathered centres were read with every row finite")
    monkeypatch.setattr(validation, "_gathered_rows_finite", no_read)
    args = good()
    args["emb"].requires_grad_(True)
    for reduction in ("mean", "sum", "none"):
        out = nnkloss.neighbour_kernel_loss_with_stats(**args, reduction=reduction,
                                                       backend=backend)
        assert torch.isfinite(out.per_row).all()
    out.loss.sum().backward()


# ------------------------------- the finiteness tests: a sum, exact only where it is inconclusive
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 70001])
def test_a_finite_sum_proves_every_value_finite(dtype, n):
    """One NaN / inf / -inf at any place (first, last, inside a vector lane, past the threaded
    grain) makes the sum non-finite: the cheap test never passes a bad tensor."""
    from nnkloss.validation import all_finite, maybe_nonfinite
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    assert not bool(maybe_nonfinite(x)) and all_finite(x)
    places = sorted({0, n // 2, n - 1, min(n - 1, 15), min(n - 1, 33000)})
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in places:
            y = x.clone()
            y[i] = bad
            assert bool(maybe_nonfinite(y)), (bad, i)
            assert not all_finite(y), (bad, i)
    both = x.clone()
    both[0], both[-1] = float("inf"), float("-inf")  # inf + -inf: NaN, still not finite
    assert not all_finite(both)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_sum_that_overflows_falls_back_to_the_exact_test(dtype):
    """Finite values whose sum overflows (bf16 / fp32 / fp64 at their maximum; fp16 is summed
    in fp32, which holds it): "perhaps" from the sum, then the exact test says finite. A check
    on the sum alone would refuse these."""
    from nnkloss.validation import all_finite, maybe_nonfinite, nonnegative_finite
    big = torch.finfo(dtype).max
    x = torch.full((4,), big, dtype=dtype)
    assert bool(maybe_nonfinite(x)) == (dtype != torch.float16)
    assert all_finite(x) and nonnegative_finite(x)
    assert all_finite(torch.empty(0, dtype=dtype)) and nonnegative_finite(torch.empty(0))


@pytest.mark.parametrize("value, ok", [
    (0.0, True), (-0.0, True), (1e-30, True), (-1e-30, False), (-1.0, False),
    (float("nan"), False), (float("inf"), False), (float("-inf"), False)])
def test_weight_test_refuses_negative_and_nonfinite(value, ok):
    from nnkloss.validation import negative_or_nonfinite, nonnegative_finite
    for n, i in ((1, 0), (50, 0), (50, 49), (70001, 40000)):
        w = torch.rand(n)
        w[i] = value
        assert nonnegative_finite(w) is ok, (value, n, i)
        assert bool(negative_or_nonfinite(w)) is not ok


def test_checks_accept_finite_values_whose_sum_overflows(checks_path):
    """emb and weights near fp32's maximum are finite: the op's checks must not refuse them
    (their sums overflow, so the exact test decides); a NaN beside them still raises."""
    from nnkloss.validation import check_values
    e, c, nb, w, s = value_args()
    e = torch.full_like(e, 3e38)
    w = torch.full_like(w, 3e38)
    assert check_values(e, c, nb, w, s, fused=CPU) is False
    e[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"^emb contains NaN or inf$"):
        check_values(e, c, nb, w, s, fused=CPU)
    e[1, 2] = 0.0
    w[3] = -1.0
    with pytest.raises(ValueError, match=r"^weights must be finite and non-negative"):
        check_values(e, c, nb, w, s, fused=CPU)
    assert checks_path is None or checks_path == [True] * 3


@pytest.mark.interpreter
@pytest.mark.parametrize("centre", [float("nan"), float("inf"), None])
def test_check_before_the_op_with_the_triton_read(monkeypatch, centre):
    """The read CUDA tensors take (kernels/gathered_finite.py), run here through Triton's
    interpreter on CPU tensors in place of torch's chunks: the same answers, the same error."""
    from nnkloss import validation
    kernels = nnkloss.ops.backends.kernels()
    triton = nnkloss.ops.backends.by_name("triton")  # the device path, on the CPU
    calls = []
    real = kernels.gathered_rows_finite
    monkeypatch.setattr(kernels, "gathered_rows_finite", lambda *a: calls.append(1) or real(*a))
    args = value_args(centre=centre)
    if centre is None:
        validation.check_values(*args, fused=triton)
    else:
        with pytest.raises(ValueError, match=GATHERED_MSG):
            validation.check_values(*args, fused=triton)
    assert calls
    emb, centres, nb, w, s = value_args(centre=float("nan"))
    validation.check_values(emb, centres, nb.masked_fill(nb == 4, -1), w, s, fused=triton)


@pytest.mark.cuda
def test_cuda_check_reads_the_gathered_centres_with_the_triton_kernel(monkeypatch):
    kernels = nnkloss.ops.backends.kernels()
    real, calls = kernels.gathered_rows_finite, []
    monkeypatch.setattr(kernels, "gathered_rows_finite", lambda *a: calls.append(1) or real(*a))
    emb, centres, nb, w, s = (t.cuda() for t in value_args(centre=float("inf")))
    from nnkloss.validation import check_values
    with pytest.raises(ValueError, match=GATHERED_MSG):
        check_values(emb, centres, nb, w, s)
    assert calls
    centres[4, 0] = 0.0
    check_values(emb, centres, nb, w, s)


@pytest.mark.parametrize("bad", [10, -2])
def test_check_before_the_op_names_an_index_outside_the_bank_before_reading_rows(bad):
    """With the gathered centres checked before the op (the CCML loss's way), a list entry
    outside the bank raises the range error naming it; no centre row is read through it."""
    from nnkloss import validation
    emb, centres, nb, w, s = value_args()
    nb = nb.clone()
    nb[1, 0] = bad
    with pytest.raises(IndexError, match=f"holds index {bad}"):
        validation.check_values(emb, centres, nb, w, s, centres_after_op=False)
