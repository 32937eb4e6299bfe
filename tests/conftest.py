"""Test set-up: without a GPU, Triton kernels run through Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported, hence here and not in a fixture.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors, which "
                            "needs TRITON_INTERPRET=1 (set here when there is no GPU)")
    config.addinivalue_line("markers", "slow: the slow tier (builds, the gate, several "
                            "processes, real data): python -m pytest -q -m slow tests")


# The slow tier: C++ builds of the CPU library, the Triton build gate, runs of several
# processes, real data and the longest sweeps. `python -m pytest -q tests` leaves it out
# (pytest.ini); `python -m pytest -q -m slow tests` runs it; CI runs both.
SLOW_FILES = {
    "test_kernels_build_gate.py",   # every gated build through Triton's compiler and ptxas
    "test_cpu_build.py",            # fresh builds of the CPU library, racing and planted ones
    "test_cpu_csrc_codegen.py",     # the library built and disassembled per instruction set
    "test_cpu_variants.py",         # one build per compile-time variant
    "test_distributed.py",          # process groups of two processes
    "test_exchange.py",             # the refresh split over two processes
}
SLOW_TESTS = (
    "test_fashion_mnist.py::test_one_epoch_on_real_images",
    "test_cpu_search.py::test_selection_is_exact_in_an_avx2_build_too",
    "test_kernels_entry_grads.py::test_entry_terms_match_the_torch_form[700-",
)


def _is_slow(item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    name = os.path.basename(path) + item.nodeid[len(path):]
    return os.path.basename(path) in SLOW_FILES or name.startswith(SLOW_TESTS)


def _uses_cpu_triton(item) -> bool:
    callspec = getattr(item, "callspec", None)
    on_cpu_triton = callspec is not None and callspec.params.get("backend") == "triton"
    return on_cpu_triton or item.get_closest_marker("interpreter") is not None


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        if _uses_cpu_triton(item):
            item.add_marker(pytest.mark.interpreter)
            # numpy's overflow / invalid-value warnings of the interpreter's exp and max on
            # the -inf and NaN rows the tests feed on purpose
            item.add_marker(pytest.mark.filterwarnings(
                "ignore::RuntimeWarning:triton.runtime.interpreter"))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    elif os.environ.get("TRITON_INTERPRET", "0") != "1":
        # On a GPU machine the kernels are compiled for CUDA (the cuda tests); the CPU-tensor
        # runs of the same checks need the interpreter: TRITON_INTERPRET=1 pytest -m interpreter
        skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
        for item in items:
            if _uses_cpu_triton(item):
                item.add_marker(skip)


# tests/mutation.sh runs with --hypothesis-profile=mutation: the same generated examples for
# every mutant and no example database. With the database, an example that fails the
# unmutated code too (a latent bug found by chance mid-run) is replayed for every later mutant
# and counted as killing it.
# CI (the environment variable CI set, as CI services and .ci/run do) loads the "ci" profile: the
# same examples on every run and no example database, so a CI result is reproducible. Recent
# Hypothesis versions have a built-in "ci" profile of their own (derandomized, no database, no
# deadline) that they load where CI is set; this one extends it, and stands in for it on older
# versions. An explicit --hypothesis-profile still wins (the plugin loads it after this file).
try:
    from hypothesis import settings as _hyp_settings
    _hyp_settings.register_profile("mutation", derandomize=True, database=None)
    try:
        _ci_parent = _hyp_settings.get_profile("ci")
    except Exception:  # no built-in "ci" profile (older Hypothesis): InvalidArgument
        _ci_parent = None
    _hyp_settings.register_profile("ci", _ci_parent, derandomize=True, database=None)
    if "CI" in os.environ:
        _hyp_settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass


@pytest.fixture
def symmetric_tiles(monkeypatch):
    """The (row0, col0) of every tile the symmetric self-search folds (nnkloss/bank/search/
    torch_search.py), with blocks of 32 points so that small data spans several; skips where the
    compiled selection is unavailable. Shared by the tests of the search's callers (the bank's
    list rebuild, the metrics)."""
    from nnkloss.bank.search import torch_search
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("no C++ compiler: torch selection only")
    monkeypatch.setattr(torch_search, "SYM_BLOCK", 32)
    monkeypatch.setattr(torch_search, "SYM_MIN_BLOCK", 1)
    monkeypatch.setattr(torch_search, "SYM_MAX_K_PER_WIDTH", 10**6)  # small widths, any k
    calls = []
    real = cpu.KnnSelection.add_symmetric
    monkeypatch.setattr(cpu.KnnSelection, "add_symmetric",
                        lambda sel, d, r0, c0: calls.append((r0, c0)) or real(sel, d, r0, c0))
    return calls
