"""Triton kernels of nnkloss, installed as ``nnkloss.kernels`` (``nnkloss/kernels`` links
here): plain tensors in, plain tensors out; no autograd, banks or training here.
"""
from .neighbour_kernel import FwdConfig, centre_grad, default_config, neighbour_kernel_fwd
from .batch_lists import batch_lists
from .entry_grads import entry_grads
from .gathered_finite import gathered_rows_finite
from .relative_distances import rel_sqdist
from .scale_rows import scale_rows

__all__ = ["neighbour_kernel_fwd", "centre_grad", "rel_sqdist", "gathered_rows_finite",
           "scale_rows", "entry_grads", "batch_lists", "FwdConfig", "default_config"]
