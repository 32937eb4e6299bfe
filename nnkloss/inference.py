"""The network at inference: what embedding a whole data set runs (a bank's refresh, an
evaluation), made cheaper without changing what it computes.

:func:`inference_model` returns an eval-mode module whose forward is the model's own in eval
mode, with every BatchNorm that directly follows a convolution or linear layer inside an
``nn.Sequential`` folded into that layer's weights and bias. In eval mode a BatchNorm is the
per-channel affine map ``y = (x - mean) / sqrt(var + eps) * gamma + beta`` with fixed
statistics, so it composes with the layer before it into one layer
(``torch.nn.utils.fusion``): one pass over the activations less per BatchNorm, and no
(B, C, H, W) intermediate between the two. The folded statistics are the running ones: a
bank's refresh recalibrates them first (:func:`nnkloss.bank.refresh.recalibrate_batch_norms`).

Only ``nn.Sequential`` containers are rewritten, because only there the layer's output is
known to be the BatchNorm's input: a module's own ``forward`` may use the two in any order.
A pair is folded only where each is of exactly one of torch's classes (a subclass may override
``forward``), the container's ``forward`` is ``nn.Sequential``'s, neither module has a hook,
and the BatchNorm uses running statistics in eval mode (``track_running_stats`` with its
buffers present; otherwise it normalises with each batch's own statistics, which no weight can
hold). A Linear's BatchNorm1d must have one feature per output feature, and is folded for
2-D inputs only: on a (B, C, L) input it normalises the C channels, not the Linear's outputs,
and the pair runs unfolded. Everything else runs as it is. The model itself is never
modified: the folding happens in a copy, made only when there is a pair to fold. Run as they
are: models holding a (Distributed)DataParallel wrapper (a copy would be a second process-group
participant), a ``torch.compile``'d module (it would compile again at every call), a parameter
that is not a plain ``nn.Parameter`` (FSDP's, lazy ones: not whole tensors a fold could read),
or anything ``copy.deepcopy`` cannot copy.
"""
from __future__ import annotations

import copy
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

__all__ = ["inference_model", "foldable_pairs", "to_device"]

# (layer class, the BatchNorm class that may follow it): exact types only.
_FOLDABLE = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d,
             nn.Linear: nn.BatchNorm1d}


def to_device(inputs, device):
    """A batch's inputs (a tensor, or tuples / lists / dicts of them) on ``device``."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device, non_blocking=True)
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(to_device(x, device) for x in inputs)
    if isinstance(inputs, dict):
        return {key: to_device(v, device) for key, v in inputs.items()}
    return inputs


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def _folds(layer: nn.Module, bn: nn.Module) -> bool:
    # torch's linear fold needs the BatchNorm's affine parameters (its conv fold does not),
    # and one BatchNorm feature per output feature (else the pair runs only on (B, C, L)
    # inputs, which no fold holds: see _LinearBatchNorm; torch's fold asserted on it).
    return (_FOLDABLE.get(type(layer)) is type(bn) and bn.track_running_stats
            and bn.running_mean is not None and bn.running_var is not None
            and (not isinstance(layer, nn.Linear)
                 or (bn.affine and layer.out_features == bn.num_features))
            and not _hooked(layer) and not _hooked(bn))


class _LinearBatchNorm(nn.Module):
    """A Linear and the BatchNorm1d after it, folded (``fused``) for 2-D inputs, the only
    ones where the BatchNorm normalises the Linear's output features. On a (B, C, L) input
    the Linear maps L and the BatchNorm normalises the C channels, which no Linear weight can
    hold (where C equals the output features the fold ran and returned other embeddings):
    such inputs run the Linear and then the BatchNorm's eval-mode map, unfolded."""

    def __init__(self, fused: nn.Linear, layer: nn.Linear, bn: nn.BatchNorm1d):
        super().__init__()
        self.fused, self.layer, self.eps = fused, layer, bn.eps
        for name in ("running_mean", "running_var", "weight", "bias"):
            self.register_buffer(name, getattr(bn, name).detach())

    def forward(self, x):
        if x.dim() == 2:
            return self.fused(x)
        y = self.layer(x)
        if y.dim() != 3:  # as BatchNorm1d refuses it
            raise ValueError(f"expected 2D or 3D input (got {y.dim()}D input)")
        return F.batch_norm(y, self.running_mean, self.running_var, self.weight, self.bias,
                            False, 0.0, self.eps)


def _wrapped(model: nn.Module) -> bool:
    """Whether the model holds a data-parallel wrapper, a torch.compile'd module, or a
    parameter that is not a plain ``nn.Parameter`` (FSDP's flat or sharded parameters, a lazy
    module's uninitialised ones, other subclasses): see the module's docstring."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    return (any(isinstance(m, wrappers) or hasattr(m, "_orig_mod") for m in model.modules())
            or any(type(p) is not nn.Parameter for p in model.parameters()))


def foldable_pairs(model: nn.Module) -> List[Tuple[str, int]]:
    """``(name of the nn.Sequential, index of the layer)`` of every (layer, BatchNorm) pair
    that :func:`inference_model` folds, in module order (none in a wrapped model)."""
    if _wrapped(model):
        return []
    pairs = []
    for name, seq in model.named_modules():
        if type(seq).forward is not nn.Sequential.forward or _hooked(seq):
            continue
        children = list(seq._modules.values())
        i = 0
        while i + 1 < len(children):
            if _folds(children[i], children[i + 1]):
                pairs.append((name, i))
                i += 2
            else:
                i += 1
    return pairs


@torch.no_grad()
def inference_model(model: nn.Module) -> nn.Module:
    """An eval-mode module that computes what ``model.eval()`` computes, with each foldable
    (layer, BatchNorm) pair of an ``nn.Sequential`` folded into the layer (see the module's
    docstring); ``model`` itself, in whatever mode it is, where there is no such pair.

    The result is a copy: the model, its parameters and its mode are left as they were, so
    call this again after the weights change (each refresh, each evaluation). The copy's
    parameters take no gradient; while it lives it holds a second set of the model's
    parameters and buffers, on the model's devices (the package's callers keep it for one
    pass over a set). Its outputs equal the model's in eval mode up to rounding
    (the folded weights are products, rounded once)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    pairs = foldable_pairs(model)
    if not pairs:
        return model
    try:
        out = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. a lock or an open file among its attributes
        return model  # what cannot be copied runs as it is: the fold is only a speed-up
    out.eval()
    modules = dict(out.named_modules())
    for name, i in pairs:
        seq = modules[name]
        keys = list(seq._modules)
        layer, bn = seq._modules[keys[i]], seq._modules[keys[i + 1]]
        if isinstance(layer, nn.Linear):
            fused = _LinearBatchNorm(fuse_linear_bn_eval(layer, bn), layer, bn)
        else:
            fused = fuse_conv_bn_eval(layer, bn)
            if layer.weight.dim() == 4 and layer.weight.is_contiguous(
                    memory_format=torch.channels_last):
                # Keep the layout the model chose (oneDNN's channels_last convolutions).
                fused.weight.data = fused.weight.data.contiguous(
                    memory_format=torch.channels_last)
        seq._modules[keys[i]] = fused
        seq._modules[keys[i + 1]] = nn.Identity()
    for p in out.parameters():
        p.requires_grad_(False)
    return out
