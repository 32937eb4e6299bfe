"""Where the op runs: backend names, their choice for a device, and their implementations.

Every backend implements the same two functions with the same contract
(``forward(emb, labels, centres, centre_labels, neighbours, weights, sigma, store_dist)`` and
``centre_grad(emb, centres, neighbours, coef)``, see :mod:`nnkloss.ops.reference`):

- ``"triton"``: the fused kernels of ``kernels/`` (installed as ``nnkloss.kernels``); CUDA
  tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``);
- ``"cpu"``: the compiled CPU kernel (:mod:`nnkloss.ops.cpu`, C++ built on first use); it
  runs the plain path itself, after a one-line notice, where no compiler is found;
- ``"torch"``: the plain chunked PyTorch path (:mod:`nnkloss.ops.reference`), any device.

"auto" picks "triton" for CUDA tensors and "cpu" for CPU tensors. The choice is made from the
device alone (nothing is built or probed here), so it is the same inside ``torch.compile``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import SimpleNamespace

import torch

from . import reference

from ..validation import BACKENDS

__all__ = ["BACKENDS", "resolve_backend", "implementation", "fused_pass"]


_TRITON_IMPORTABLE: list = []  # the answer, once known


def _triton_importable() -> bool:
    """Whether triton imports here, asked once per process. Plain code that torch.compile
    traces as it is (the op's "auto" is resolved inside compiled code: an lru_cache there
    drew Dynamo's warning on every compiled loss, seen on the first GPU run; marking it
    constant would import torch._dynamo, and with it triton, at ``import nnkloss``)."""
    if not _TRITON_IMPORTABLE:
        try:
            import triton  # noqa: F401
            ok = True
        except Exception:  # triton absent or broken: the torch path still works
            ok = False
        _TRITON_IMPORTABLE.append(ok)
    return _TRITON_IMPORTABLE[0]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend and refuse combinations that cannot run."""
    if backend == "auto":
        if device.type == "cuda" and _triton_importable():
            return "triton"
        return "cpu" if device.type == "cpu" else "torch"
    if backend == "cpu" and device.type != "cpu":
        raise RuntimeError(f"backend='cpu' needs CPU tensors, got {device}")
    if backend == "triton":
        if not _triton_importable():
            raise RuntimeError("backend='triton' needs the triton package; install it or use "
                               "backend='torch'")
        if device.type == "cpu" and not _interpreting():
            raise RuntimeError("backend='triton' on CPU tensors runs only under Triton's "
                               "interpreter: set TRITON_INTERPRET=1 before importing nnkloss")
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"backend='triton' does not support device {device}")
    return backend


def kernels():
    """The ``nnkloss.kernels`` package (imported lazily: triton is only needed there)."""
    try:
        return importlib.import_module("nnkloss.kernels")
    except ModuleNotFoundError as exc:
        if exc.name != "nnkloss.kernels":
            raise
        return _source_tree_kernels()


def _source_tree_kernels():
    """Running from a source checkout that was not pip-installed (PYTHONPATH=.): kernels/ sits
    beside nnkloss/ and is mapped to nnkloss.kernels the way setup.py's package_dir does."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.join(os.path.dirname(os.path.dirname(here)), "kernels")
    init = os.path.join(root, "__init__.py")
    if not os.path.exists(init):
        raise ModuleNotFoundError("nnkloss.kernels is missing: reinstall nnkloss "
                                  "(pip install -e .)", name="nnkloss.kernels")
    spec = importlib.util.spec_from_file_location("nnkloss.kernels", init,
                                                  submodule_search_locations=[root])
    module = importlib.util.module_from_spec(spec)
    sys.modules["nnkloss.kernels"] = module
    spec.loader.exec_module(module)
    import nnkloss
    nnkloss.kernels = module
    return module


def implementation(backend: str):
    """The ``forward`` / ``centre_grad`` pair of a concrete backend name."""
    if backend == "triton":
        k = kernels()
        return SimpleNamespace(forward=k.neighbour_kernel_fwd, centre_grad=k.centre_grad)
    if backend == "cpu":
        from .. import cpu
        return cpu
    if backend == "torch":
        return reference
    raise ValueError(f"backend must be one of {BACKENDS[1:]} here, got {backend!r}")


def fused_pass(device: torch.device):
    """Where the one-pass helpers beside the op run for tensors on ``device``, or None: the
    compiled CPU library (:mod:`nnkloss.ops.cpu`) for CPU tensors, the Triton kernels
    (``nnkloss.kernels``) for CUDA tensors when triton is installed. Both offer the same names
    (``rel_sqdist``: the classifier's distances; ``gathered_rows_finite``: the value check of
    the gathered centres); the CPU's return None where they do not apply (the library not
    built, other dtypes), the caller's torch form then runs."""
    if device.type == "cpu":
        from .. import cpu
        return cpu
    if resolve_backend("auto", device) == "triton":
        return kernels()
    return None
