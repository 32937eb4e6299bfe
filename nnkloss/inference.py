"""The network at inference, made cheaper without changing what it computes: BatchNorms folded
into the convolution or linear layer they follow (:func:`inference_model`)."""
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
    # torch's linear fold needs an affine BatchNorm of one feature per output feature.
    return (_FOLDABLE.get(type(layer)) is type(bn) and bn.track_running_stats
            and bn.running_mean is not None and bn.running_var is not None
            and (not isinstance(layer, nn.Linear)
                 or (bn.affine and layer.out_features == bn.num_features))
            and not _hooked(layer) and not _hooked(bn))


class _LinearBatchNorm(nn.Module):
    """A Linear and its BatchNorm1d: folded (``fused``) for 2-D inputs; a (B, C, L) input,
    where the BatchNorm normalises the channels, runs the two unfolded."""

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


def foldable_pairs(model: nn.Module) -> List[Tuple[str, int]]:
    """``(name of the nn.Sequential, index of the layer)`` of every (layer, BatchNorm) pair
    that :func:`inference_model` folds, in module order (none in a wrapped model)."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)  # or compiled modules
    if (any(isinstance(m, wrappers) or hasattr(m, "_orig_mod") for m in model.modules())
            or any(type(p) is not nn.Parameter for p in model.parameters())):  # odd parameters
        return []
    pairs = []
    for name, seq in model.named_modules():
        if type(seq).forward is not nn.Sequential.forward or _hooked(seq):
            continue
        children = list(seq._modules.values())  # a BatchNorm never starts a pair
        pairs += [(name, i) for i in range(len(children) - 1)
                  if _folds(children[i], children[i + 1])]
    return pairs


@torch.no_grad()
def inference_model(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` with its foldable pairs folded (equal to ``model.eval()``
    up to rounding, no gradients), or ``model`` itself where nothing folds. ``model`` is left
    as it was; call again after its weights change."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    pairs = foldable_pairs(model)
    if not pairs:
        return model
    try:
        out = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. a lock among its attributes
        return model  # the fold is only a speed-up
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
                fused.weight.data = fused.weight.data.contiguous(memory_format=torch.channels_last)
        seq._modules[keys[i]] = fused
        seq._modules[keys[i + 1]] = nn.Identity()
    return out.requires_grad_(False)
