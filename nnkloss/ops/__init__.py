"""The op: the fused neighbour-kernel loss, forward and backward, on every backend.

- :mod:`.neighbour_kernel`: the one autograd definition, its custom op, the functional API;
- :mod:`.backends`: the interface of the op's passes and its implementations (the Triton
  kernels of ``kernels/``, installed as ``nnkloss.kernels``; the compiled CPU library
  :mod:`.cpu`; the plain PyTorch reference :mod:`.reference`, the oracle of the others).

Every backend follows one forward contract, ``nnkloss/ops/CONTRACT.md``. Nothing here knows
of banks, refreshes or training.
"""
from .backends import resolve_backend
from .neighbour_kernel import (LossOutput, loss_rows_unchecked, neighbour_kernel_loss,
                               neighbour_kernel_loss_with_stats, reduce_rows)

__all__ = ["LossOutput", "loss_rows_unchecked", "neighbour_kernel_loss",
           "neighbour_kernel_loss_with_stats", "reduce_rows", "resolve_backend"]
