"""Where the op runs: one interface for its passes, one implementation per backend.

The passes (ops/CONTRACT.md): ``forward`` (the contract's five outputs, with ``mean`` also
``counted``, the counted mean and its divisor; ``lean``: lse_all and dist may be None without
``store_dist``, as the eager carrier reads neither then); ``scale_rows`` (the embedding gradient);
``entry_grads`` and ``centre_grad`` (the centre, weight and sigma gradients); ``batch_lists``
(a batch's lists in one call, or None: the bank's torch route runs); ``counted_mean``;
``gathered_rows_finite`` and ``value_flags`` (the value checks' reads, None: their torch form).

:class:`TorchBackend` (``"torch"``, :mod:`nnkloss.ops.reference`, any device: the fp64 oracle),
:class:`TritonBackend` (``"triton"``, ``kernels/``: CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) and :class:`CpuBackend` (``"cpu"``, the compiled CPU library). A fused
pass falls back to the torch form where it cannot serve: traced (torch.compile fuses the torch
form), under a dispatch mode, or a recorded backward (create_graph=True).

:func:`backend` resolves a choice ("auto": Triton for CUDA tensors, the CPU library for CPU
tensors, torch elsewhere) once per (device, dtype, choice), building nothing, so it is the same
inside torch.compile.
"""
from __future__ import annotations

import importlib
import os

import torch

from .. import cpu
from . import reference
from ..validation import BACKENDS, plain_eager

__all__ = ["BACKENDS", "backend", "by_name", "resolve_backend", "kernels", "fused_pass",
           "TorchBackend", "TritonBackend", "CpuBackend"]


def _fused(*tensors) -> bool:
    """Whether a fused pass may serve: plain eager tensors, outside a recorded backward."""
    return not torch.is_grad_enabled() and plain_eager(*tensors)


class TorchBackend:
    """The plain PyTorch implementation of every pass (:mod:`nnkloss.ops.reference`)."""
    name = "torch"
    batch_lists = None

    def forward(self, emb, labels, centres, centre_labels, neighbours, weights, sigma,
                store_dist=True, need_grad_x=True, mean=False, lean=False):
        return reference.forward(emb, labels, centres, centre_labels, neighbours, weights, sigma,
                                 store_dist=store_dist, need_grad_x=need_grad_x, mean=mean)

    counted_mean = staticmethod(reference.counted_mean)
    centre_grad = staticmethod(reference.centre_grad)
    entry_grads = staticmethod(reference.entry_grads)
    scale_rows = staticmethod(reference.scale_rows)

    def gathered_rows_finite(self, centres, neighbours):
        return None

    def value_flags(self, emb, neighbours, weights):
        return None


class CpuBackend(TorchBackend):
    """The compiled CPU library (``nnkloss.cpu``, built on first use)."""
    name = "cpu"

    @property
    def batch_lists(self):  # its counts are host ints
        return cpu.batch_lists

    forward = staticmethod(cpu.forward)
    centre_grad = staticmethod(cpu.centre_grad)

    def scale_rows(self, grad_x, g, lse_pos, out_dtype, divisor=None):
        if not _fused(grad_x, g):
            return reference.scale_rows(grad_x, g, lse_pos, out_dtype, divisor)
        out = cpu.scale_rows(grad_x, g, lse_pos, divisor)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def entry_grads(self, u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g,
                    sigma, need_c, need_w, need_s):
        out = None
        if _fused(u, lse_pos, g):
            out = cpu.entry_grads(u, labels, centre_labels, neighbours, weights, lse_all,
                                  lse_pos, g, sigma, need_c, need_w, need_s)
        if out is None:
            out = reference.entry_grads(u, labels, centre_labels, neighbours, weights,
                                        lse_all, lse_pos, g, sigma, need_c, need_w, need_s)
        return out

    def gathered_rows_finite(self, centres, neighbours):
        return cpu.gathered_rows_finite(centres.detach(), neighbours)

    def value_flags(self, emb, neighbours, weights):
        return cpu.value_flags(emb, neighbours, weights)


class TritonBackend(TorchBackend):
    """The Triton kernels of ``kernels/`` (``nnkloss.kernels``)."""
    name = "triton"

    def __init__(self):
        self.k = kernels()

    @property
    def batch_lists(self):
        return self.k.batch_lists

    def forward(self, emb, labels, centres, centre_labels, neighbours, weights, sigma,
                store_dist=True, need_grad_x=True, mean=False, lean=False):
        return self.k.neighbour_kernel_fwd(emb, labels, centres, centre_labels, neighbours,
                                           weights, sigma, store_dist=store_dist,
                                           need_grad_x=need_grad_x, mean=mean)

    def centre_grad(self, emb, centres, neighbours, coef):
        return self.k.centre_grad(emb, centres, neighbours, coef)

    def scale_rows(self, grad_x, g, lse_pos, out_dtype, divisor=None):
        if not _fused(grad_x, g):
            return reference.scale_rows(grad_x, g, lse_pos, out_dtype, divisor)
        return self.k.scale_rows(grad_x, g, lse_pos, out_dtype, divisor)

    def entry_grads(self, u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g,
                    sigma, need_c, need_w, need_s):
        args = (u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g, sigma,
                need_c, need_w, need_s)
        if _fused(u, labels, centre_labels, neighbours, lse_all, lse_pos, g, sigma):
            return self.k.entry_grads(*args)
        return reference.entry_grads(*args)

    def gathered_rows_finite(self, centres, neighbours):
        return self.k.gathered_rows_finite(centres.detach(), neighbours)


_TRITON_IMPORTABLE: list = []  # the answer, once known


def _triton_importable() -> bool:
    """Whether triton imports here, asked once per process (plain code that torch.compile
    traces as it is: an lru_cache drew Dynamo's warning on every compiled loss)."""
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


def resolve_backend(choice: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend name and refuse combinations that cannot run."""
    if choice == "auto":
        if device.type == "cuda" and _triton_importable():
            return "triton"
        return "cpu" if device.type == "cpu" else "torch"
    if choice == "cpu" and device.type != "cpu":
        raise RuntimeError(f"backend='cpu' needs CPU tensors, got {device}")
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError("backend='triton' needs the triton package; install it or use "
                               "backend='torch'")
        if device.type == "cpu" and not _interpreting():
            raise RuntimeError("backend='triton' on CPU tensors runs only under Triton's "
                               "interpreter: set TRITON_INTERPRET=1 before importing nnkloss")
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"backend='triton' does not support device {device}")
    return choice


_IMPLS = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}
_BY_NAME: dict = {}
_RESOLVED: dict = {}


def by_name(name: str) -> TorchBackend:
    """The implementation of a concrete backend name (one instance each)."""
    impl = _BY_NAME.get(name)
    if impl is None:
        if name not in _IMPLS:
            raise ValueError(f"backend must be one of {BACKENDS[1:]} here, got {name!r}")
        impl = _BY_NAME[name] = _IMPLS[name]()
    return impl


def backend(choice: str, device: torch.device, dtype: torch.dtype) -> TorchBackend:
    """The implementation for tensors of ``device`` and ``dtype`` under ``choice``, resolved
    once per (device, dtype, choice)."""
    key = (device, dtype, choice)
    impl = _RESOLVED.get(key)
    if impl is None or impl.name == "triton" and device.type == "cpu":  # the interpreter's
        impl = _RESOLVED[key] = by_name(resolve_backend(choice, device))  # switch: re-read
    return impl


def kernels():
    """The ``nnkloss.kernels`` package, imported on first use (only it needs triton)."""
    return importlib.import_module("nnkloss.kernels")


def fused_pass(device: torch.device):
    """Where the one-pass helpers beside the op (``rel_sqdist``, ``gathered_rows_finite``) run
    for tensors on ``device``: the compiled CPU library for CPU tensors, the Triton kernels for
    CUDA tensors with triton installed; None elsewhere. The CPU's return None where they do
    not apply (the library not built, other dtypes): the caller's torch form then runs."""
    if device.type == "cpu":
        return cpu
    if resolve_backend("auto", device) == "triton":
        return kernels()
    return None
