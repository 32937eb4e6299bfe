"""Embedding networks for the papers' experiments and the digits demo, plus a softmax head.

Every network maps images to ``(B, D)`` float32 embeddings; embedding dropout acts in
``train()`` mode only, so a Refresher's centres (``eval()``) have none. The torchvision
architectures start from ``weights=None``; pretrained weights come from a local file only.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checksum import load_weights_only

__all__ = ["DigitsNet", "EmbeddingNet", "SoftmaxHead", "build_embedding_net",
           "load_state_dict_file", "ARCHITECTURES", "MIN_IMAGE_SIZE"]

#: Smallest square input each architecture accepts.
MIN_IMAGE_SIZE = {"googlenet": 16, "alexnet": 63, "vgg16": 32, "resnet50": 16}
ARCHITECTURES = tuple(MIN_IMAGE_SIZE)
# The layers a pretrained file may differ in (replaced here), and the feature size.
_REPLACED = {"googlenet": (("fc.", "aux1.", "aux2."), 1024), "alexnet": (("classifier.6.",), 4096),
             "vgg16": (("classifier.6.",), 4096), "resnet50": (("fc.",), 2048)}


class DigitsNet(nn.Module):
    """A small CNN for 8x8 greyscale digits (scikit-learn's ``load_digits``).

    Args:
        dim: embedding size D.
        width: channels of the first conv layer (the second has twice as many).
        dropout: dropout on the hidden layer (training only).
        embed_dropout: dropout on the embedding itself (training only).
    ``forward(x)``: x (B, 1, 8, 8) or (B, 64) float32 in roughly [0, 1] -> (B, D) float32.
    """

    def __init__(self, dim: int = 64, width: int = 32, dropout: float = 0.2,
                 embed_dropout: float = 0.0):
        super().__init__()
        self.dim = dim
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Flatten(),
            nn.Linear(2 * width * 16, 256), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(256, dim),  # the embedding: no ReLU, as for FC7 in the papers
        )
        self.embed_dropout = nn.Dropout(embed_dropout)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.view(-1, 1, 8, 8)
        return self.embed_dropout(self.features(x))


class EmbeddingNet(nn.Module):
    """A backbone producing (B, F) features, an optional final FC to ``dim``, then dropout.

    Args:
        backbone: module mapping images (B, 3, H, W) to (B, F).
        feature_dim: F.
        dim: size of an extra final FC layer; None embeds with the backbone's features.
        dropout: dropout on the embedding (training only).
        relu: a ReLU on the embedding (the softmax baselines' FC7 keeps it).
    """

    def __init__(self, backbone: nn.Module, feature_dim: int, dim: Optional[int] = None,
                 dropout: float = 0.0, relu: bool = False):
        super().__init__()
        self.backbone = backbone
        self.fc = nn.Linear(feature_dim, dim) if dim is not None else None
        self.relu = relu
        self.dropout = nn.Dropout(dropout)
        self.dim = dim if dim is not None else feature_dim

    def forward(self, x: Tensor) -> Tensor:
        h = self.backbone(x)
        if self.fc is not None:
            h = self.fc(h)
        if self.relu:
            h = F.relu(h)
        return self.dropout(h)


class SoftmaxHead(nn.Module):
    """Linear classifier + cross-entropy, with the kernel loss's call signature.

    ``forward(emb, labels, idx=None)`` -> 0-dim mean cross-entropy (``idx`` ignored);
    ``logits(emb)`` -> (B, C); ``predict(emb)`` -> (B,) int64. Its parameters train as the
    network's (it declares no ``parameter_groups``).
    """

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(dim, num_classes)

    def logits(self, emb: Tensor) -> Tensor:
        return self.fc(emb.float())

    def forward(self, emb: Tensor, labels: Tensor, idx: Optional[Tensor] = None) -> Tensor:
        return F.cross_entropy(self.logits(emb), labels.to(emb.device))

    @torch.no_grad()
    def predict(self, emb: Tensor) -> Tensor:
        return self.logits(emb).argmax(1)


def load_state_dict_file(path: str) -> dict:
    """A state dict saved with ``torch.save`` (raw, or under "state_dict"/"model"), read by
    :func:`nnkloss.checksum.load_weights_only`; ValueError naming the file otherwise."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file not found: {path}")
    obj = load_weights_only(path, "cpu", where=f"pretrained weights {path}")
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise ValueError(f"{path} does not hold a state dict of tensors (str keys)")
    # Checkpoints saved from DataParallel prefix every key with "module.".
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def _load_into(model: nn.Module, path: str, drop_prefixes: Tuple[str, ...]) -> None:
    """Load ``path`` into ``model``; the layers being replaced (``drop_prefixes``) may differ or
    be absent, everything else must match exactly."""
    sd, own = ({k: v for k, v in d.items() if not k.startswith(drop_prefixes)}
               for d in (load_state_dict_file(path), model.state_dict()))
    problems = {"missing keys": sorted(set(own) - set(sd)),
                "unexpected keys": sorted(set(sd) - set(own)),
                "shape mismatch": sorted(k for k in set(own) & set(sd)
                                         if own[k].shape != sd[k].shape)}
    if any(problems.values()):
        raise ValueError(f"pretrained weights {path} do not fit {type(model).__name__}: "
                         + "; ".join(f"{what}: {', '.join(keys[:5])}"
                                     + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
                                     for what, keys in problems.items() if keys))
    model.load_state_dict(sd, strict=False)


def build_embedding_net(arch: str, dim: Optional[int] = None, dropout: float = 0.5,
                        pretrained: Optional[str] = None, relu: bool = False) -> EmbeddingNet:
    """A torchvision architecture as an embedding network.

    Args:
        arch: "googlenet" (1024-d), "alexnet" / "vgg16" (FC7 before its ReLU, 4096-d) or
            "resnet50" (2048-d).
        dim, dropout, relu: as :class:`EmbeddingNet`.
        pretrained: a local torchvision-format state dict of the full model (its final
            classifier layer is ignored); GoogLeNet then normalises its input as
            torchvision's ImageNet weights expect (``transform_input``).
    Returns:
        an :class:`EmbeddingNet`; its ``dim`` is the embedding size.
    """
    try:
        from torchvision import models
    except ImportError as e:  # pragma: no cover - torchvision is in the "vision" extra
        raise ImportError("the image architectures need torchvision (pip install "
                          "torchvision)") from e
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    if arch == "googlenet":
        net = models.googlenet(weights=None, aux_logits=False, init_weights=True,
                               transform_input=pretrained is not None)
    else:
        net = getattr(models, arch)(weights=None)
    replaced, feat = _REPLACED[arch]
    if pretrained:
        _load_into(net, pretrained, replaced)
    if arch in ("alexnet", "vgg16"):
        # AlexNet: Dropout, FC6, ReLU, Dropout, FC7 | VGG16: FC6, ReLU, Dropout, FC7.
        net.classifier = net.classifier[:5 if arch == "alexnet" else 4]
    else:
        net.fc = nn.Identity()
    return EmbeddingNet(net, feat, dim, dropout, relu)
