"""nnkloss/ops/backends.py: which implementation runs where (resolve_backend, implementation),
Triton on CPU tensors only under its interpreter, and the kernels of a source checkout."""
import pytest
import torch

import nnkloss
from cases import good_op_args as good


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_resolve_backend_table(monkeypatch):
    """Every row of backends.resolve_backend, with its exact errors. Kills ops.backends
    resolve_backend 4-11, 14-18, 20-22, 26, 31-35, 42-47, 51-53 (on a CPU-only machine "auto"
    on CPU under the interpreter gave the same numbers through Triton, so only the choice
    itself tells them apart)."""
    from nnkloss.ops import backends
    cpu_dev, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backends, "_triton_importable", lambda: True)
    assert backends.resolve_backend("auto", cpu_dev) == "cpu"
    assert backends.resolve_backend("auto", cuda) == "triton"
    assert backends.resolve_backend("auto", meta) == "torch"
    for name in ("cpu", "torch", "triton"):
        assert backends.resolve_backend(name, cpu_dev) == name
    assert backends.resolve_backend("triton", cuda) == "triton"
    assert backends.resolve_backend("torch", cuda) == "torch"
    assert backends.resolve_backend("torch", meta) == "torch"
    with pytest.raises(RuntimeError, match=r"^backend='cpu' needs CPU tensors, got cuda$"):
        backends.resolve_backend("cpu", cuda)
    with pytest.raises(RuntimeError, match=r"^backend='triton' does not support device meta$"):
        backends.resolve_backend("triton", meta)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"^backend='triton' on CPU tensors runs only under "
                                           r"Triton's interpreter: set TRITON_INTERPRET=1 "
                                           r"before importing nnkloss$"):
        backends.resolve_backend("triton", cpu_dev)
    monkeypatch.setattr(backends, "_triton_importable", lambda: False)
    assert backends.resolve_backend("auto", cuda) == "torch"
    with pytest.raises(RuntimeError, match=r"^backend='triton' needs the triton package; "
                                           r"install it or use backend='torch'$"):
        backends.resolve_backend("triton", cuda)


@pytest.mark.parametrize("value, ok", [("1", True), ("0", False), (None, False), ("", False)])
def test_triton_on_cpu_follows_triton_interpret(monkeypatch, value, ok):
    """Kills ops.backends _interpreting 3, 5, 6, 9 (variable name or value changed: the
    interpreter's CPU runs were refused, or allowed without it). 2, 4, 7 (default value of the
    lookup) are equivalent: an unset variable is "not 1" either way."""
    from nnkloss.ops import backends
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    if ok:
        assert backends.resolve_backend("triton", torch.device("cpu")) == "triton"
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            backends.resolve_backend("triton", torch.device("cpu"))


def test_kernels_is_an_ordinary_package_of_the_source_tree():
    """nnkloss/kernels is a link to the repository's kernels/ (setup.py installs kernels/ as
    nnkloss.kernels): it imports as a package like any other, no sys.modules remap."""
    import importlib
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module = importlib.import_module("nnkloss.kernels")
    assert os.path.samefile(module.__file__, os.path.join(root, "kernels", "__init__.py"))
    assert os.path.islink(os.path.join(root, "nnkloss", "kernels"))
    assert nnkloss.ops.backends.kernels() is module
    assert callable(module.neighbour_kernel_fwd) and callable(module.centre_grad)


PASSES = ("forward", "scale_rows", "entry_grads", "centre_grad", "counted_mean",
          "gathered_rows_finite", "value_flags")


def test_one_interface_one_implementation_per_backend(monkeypatch):
    """Every backend offers every pass; each name has one instance, and a choice is resolved
    once per (device, dtype, choice): the same object every call, nothing probed again."""
    from nnkloss.ops import backends
    impls = {name: backends.by_name(name) for name in ("torch", "cpu", "triton")}
    assert [type(i) for i in impls.values()] == [backends.TorchBackend, backends.CpuBackend,
                                                 backends.TritonBackend]
    for name, impl in impls.items():
        assert impl.name == name and backends.by_name(name) is impl
        assert all(callable(getattr(impl, p)) for p in PASSES)
    assert impls["torch"].batch_lists is None
    assert impls["cpu"].batch_lists is nnkloss.cpu.batch_lists
    assert impls["triton"].batch_lists is backends.kernels().batch_lists
    cpu_dev = torch.device("cpu")
    assert backends.backend("auto", cpu_dev, torch.float32) is impls["cpu"]
    monkeypatch.setattr(backends, "resolve_backend", lambda *a: pytest.fail("resolved again"))
    assert backends.backend("auto", cpu_dev, torch.float32) is impls["cpu"]
    with pytest.raises(ValueError, match=r"^backend must be one of .*'triton'.*'cpu'.*'torch'.* "
                                         r"here, got 'auto'$"):
        backends.by_name("auto")


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_errors.py (now tests/test_validation.py) in issue 19.
def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        nnkloss.neighbour_kernel_loss(**good(), backend="triton")


def test_source_checkout_without_install_finds_the_kernels(tmp_path):
    """PYTHONPATH=<checkout> with no pip install (as on a bare GPU machine): kernels/ still
    serves as nnkloss.kernels."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', type(f).__name__)]\n"
        "import torch, nnkloss\n"
        "assert not nnkloss.__file__.startswith(sys.prefix)\n"
        "e = torch.randn(3, 4); c = torch.randn(6, 4)\n"
        "out = nnkloss.neighbour_kernel_loss(e, torch.tensor([0, 1, 0]), c,\n"
        "    torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([[0, 1], [2, 3], [4, 5]]),\n"
        "    backend='triton')\n"
        "ref = nnkloss.neighbour_kernel_loss(e, torch.tensor([0, 1, 0]), c,\n"
        "    torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([[0, 1], [2, 3], [4, 5]]),\n"
        "    backend='torch')\n"
        "torch.testing.assert_close(out, ref)\n"
        "import nnkloss.kernels as k\n"
        "import os\n"
        f"assert os.path.samefile(k.__file__, {os.path.join(root, 'kernels', '__init__.py')!r})\n"
    )
    env = dict(os.environ, PYTHONPATH=root, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_fused_pass_by_device_offers_the_same_helpers():
    """fused_pass: the compiled CPU library for CPU tensors, the Triton kernels on CUDA (with
    triton), none elsewhere; both with the helpers the classifier and the value checks call."""
    from nnkloss import cpu
    from nnkloss.ops.backends import fused_pass, kernels
    assert fused_pass(torch.device("cpu")) is cpu
    assert fused_pass(torch.device("meta")) is None
    for impl in (cpu, kernels()):
        assert callable(impl.rel_sqdist) and callable(impl.gathered_rows_finite)
    if torch.cuda.is_available():
        assert fused_pass(torch.device("cuda")) is kernels()


@pytest.mark.parametrize("asked_before", [True, False])
def test_triton_probe_traces_in_torch_compile_without_warnings(monkeypatch, asked_before):
    """The op resolves "auto" inside compiled code: the probe is traced whole (fullgraph),
    whether or not it was asked before, without Dynamo's warning about cache wrappers (an
    lru_cache had one on every compiled loss)."""
    import warnings

    from nnkloss.ops import backends
    want = backends._triton_importable()
    assert backends._triton_importable() is want
    if not asked_before:
        monkeypatch.setattr(backends, "_TRITON_IMPORTABLE", [])

    def f(x):
        return x + int(backends._triton_importable())
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
    assert out.tolist() == [float(want)] * 2
    assert not [w for w in seen if "cache" in str(w.message)], [str(w.message) for w in seen]
