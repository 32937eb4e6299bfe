"""``nnkloss.kernels`` for tests, also from a checkout that was not pip-installed.

There ``kernels/`` is mapped to ``nnkloss.kernels`` only when the Triton path is first used,
so ``from nnkloss import kernels`` works or fails depending on which tests ran before.
"""
import importlib

import torch

import nnkloss


def kernels(submodule: str = ""):
    name = "nnkloss.kernels" + (f".{submodule}" if submodule else "")
    try:
        return importlib.import_module(name)
    except (ModuleNotFoundError, ImportError):
        # The first use of the Triton path maps kernels/ (CPU tensors: under the interpreter).
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.zeros(1, 1, device=dev)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        nnkloss.neighbour_kernel_loss(x, zero, x, zero, zero[:, None], backend="triton")
        return importlib.import_module(name)
