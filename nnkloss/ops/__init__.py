"""The op: the fused neighbour-kernel loss, forward and backward, on every backend.

- :mod:`.neighbour_kernel`: custom-op registration, the host backward, the functional API;
- :mod:`.backends`: backend names and choice; the Triton kernels live in ``kernels/`` at the
  top of the repository (installed as ``nnkloss.kernels``);
- :mod:`.cpu`: the compiled CPU kernel (``cpu_kernel.cpp``, built on first use);
- :mod:`.reference`: the plain chunked PyTorch implementation, the reference the others are
  tested against.

Every backend follows one forward contract, ``nnkloss/ops/CONTRACT.md``. Nothing here knows
of banks, refreshes or training.
"""
from .backends import resolve_backend
from .neighbour_kernel import (LossOutput, loss_rows_unchecked, neighbour_kernel_loss,
                               neighbour_kernel_loss_with_stats, reduce_rows)

__all__ = ["LossOutput", "loss_rows_unchecked", "neighbour_kernel_loss",
           "neighbour_kernel_loss_with_stats", "reduce_rows", "resolve_backend"]
