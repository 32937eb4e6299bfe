"""Fashion-MNIST benchmark: the kernel loss (NNGK) against pytorch-metric-learning's losses.

    python repro/fashion_mnist.py --data-root DIR --protocol retrieval|classification \\
        --train-classes 0 1 2 3 4 --methods nngk contrastive ... --seeds 0 1 2 \\
        --epochs E --out DIR [--quick]

``--data-root``: a local folder with the four official IDX files (gzipped or not), flat like
Debian's ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``) or
torchvision's ``FashionMNIST/raw`` layout. Nothing is downloaded.

Protocols (the papers' two, in miniature):

* ``retrieval`` (unseen classes): train on the training images of ``--train-classes``, embed
  the test images of the other classes, report Recall@1/2/4/8, MAP@R and NMI (k-means with
  ``--nmi-inits`` initialisations).
* ``classification``: all ten classes; test accuracy of the kernel classifier (Eq. 3 over a
  bank of the training embeddings) for ``nngk`` and of the softmax layer for ``softmax``.

``--eval-on val`` replaces the test images by a validation split carved out of the training
data, for choosing hyperparameters: retrieval trains on the first train classes and evaluates
on the training images of the last ``--val-classes`` of them (unseen during training);
classification holds out ``--val-fraction`` of the training images (stratified, seed 0). The
test images are then never read.

Methods (same network, optimiser, batches, augmentation and epochs for all):
``nngk``; from pytorch-metric-learning with its standard settings: ``contrastive``, ``triplet``
(+ semi-hard TripletMarginMiner), ``multisimilarity`` (+ MultiSimilarityMiner), ``nca``,
``proxyanchor``, ``normsoftmax``, ``arcface``; ``softmax`` (linear layer + cross-entropy on the
embedding); ``pixels`` (no training: the raw 784 pixels, a floor). ``--method-args`` sets a
PML loss's own knobs, ``--tag`` keeps a variant as METHOD-TAG: ``repro/fashion_benchmark.py``
tunes every method that way and runs the paired, two-split benchmark (repro/README.md).

Outputs in ``--out``: ``runs/<method>-s<seed>/`` (the run's log, checkpoint and
``result.json``), ``results.json`` (every run: metrics, wall times, configuration, machine load;
and the summary over seeds), ``summary.csv``, ``results.md`` and ``recall.png`` (Recall@K with
error bars, MAP@R) or ``accuracy.png``.

A run of another configuration found under a run's name is moved to
``superseded/<name>-s<seed>.<n>/`` (without its checkpoint), never deleted, and listed under
"superseded" in results.json: the record of every configuration tried in ``--out``.

Resumable: a (method, seed) whose ``result.json`` holds the same configuration is not run
again; an interrupted run continues from its last epoch checkpoint (its training and wall times
are then None: only the part after the checkpoint was timed, kept as ``train_time_this_process_s``
beside ``resumed_from_epoch``). Numbers in results.json are fractions in [0, 1].
"""
from __future__ import annotations

import argparse
import csv
import importlib
import inspect
import io
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnkloss.atomic import atomic_write
from nnkloss.bank.refresh import RefreshSchedule
from nnkloss.evaluation import metrics as M
from nnkloss.experiment.datasets import IDXDataset, IndexedTensorDataset, stratified_split
from nnkloss.experiment.evaluate import (classification_metrics, extract_embeddings,
                                         nearest_neighbour_accuracy)
from nnkloss.experiment.models import SoftmaxHead
from nnkloss.experiment.reporting import git_commit, markdown_table, write_json, write_table
from nnkloss.experiment.setup import HelpFormatter, kernel_criterion, resolve_device
from nnkloss.experiment.seeds import seed_arg
from nnkloss.experiment.train import Trainer, seed_everything

PML_METHODS = ("contrastive", "triplet", "multisimilarity", "nca", "proxyanchor",
               "normsoftmax", "arcface")
METHODS = ("nngk",) + PML_METHODS + ("softmax", "pixels")
#: methods with parameters of their own (class proxies / weight matrices).
PROXY_METHODS = ("proxyanchor", "normsoftmax", "arcface")
RECALL_KS = (1, 2, 4, 8)
RETRIEVAL_KEYS = tuple(f"recall@{k}" for k in RECALL_KS) + ("map@r", "nmi")
RUN_FORMAT = "nnkloss.fashion_mnist/1"
# The batch of the inference passes over whole sets (the bank's refresh, the evaluation's
# embeddings; the training batch is --batch-size): at 128 images the network's largest
# activations (16 x 28 x 28 fp32, 6.4 MB) stay in the caches, at 512 they do not. The same
# embeddings either way, up to rounding.
INFERENCE_BATCH = 128


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--data-root", required=True,
                   help="folder with the four IDX files (flat, or torchvision's layout)")
    p.add_argument("--protocol", choices=("retrieval", "classification"), default="retrieval")
    p.add_argument("--train-classes", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help="retrieval: the classes trained on (the others are tested)")
    p.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                   help="default: all (retrieval) / nngk softmax (classification)")
    p.add_argument("--seeds", type=seed_arg, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=None, help="default 4 (1 with --quick)")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 epoch on 300 training and 200 evaluation images per class")
    p.add_argument("--eval-on", choices=("test", "val"), default="test",
                   help="evaluate on the test images or on a validation split of the training "
                        "data (hyperparameter search)")
    p.add_argument("--val-classes", type=int, default=2,
                   help="retrieval, --eval-on val: the last this many train classes are held out")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="classification, --eval-on val: held-out share of the training images")
    p.add_argument("--train-per-class", type=int, default=None,
                   help="use at most this many training images per class (seeded, same for all)")
    p.add_argument("--eval-per-class", type=int, default=None,
                   help="evaluate at most this many images per class (default: all; 1000 for "
                        "retrieval validation, the size of a test class)")
    # the shared training set-up
    p.add_argument("--dim", type=int, default=64, help="embedding size")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv block")
    p.add_argument("--memory-format", choices=("channels_last", "contiguous"),
                   default="channels_last",
                   help="the network's weights' memory format (the same for every method). "
                        "channels_last: oneDNN's convolutions and torch's max-pool run "
                        "channels-innermost on CPU, measured 2.1x faster inference and 1.4x "
                        "faster training steps than contiguous (NCHW) at 1 thread")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (network)")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW decoupled decay")
    p.add_argument("--loss-lr", type=float, default=1e-2,
                   help="learning rate of the losses' own parameters (proxies, class weights)")
    p.add_argument("--shift", type=int, default=2, help="augmentation: random shift (pixels)")
    p.add_argument("--no-flip", action="store_true", help="no random horizontal flips")
    p.add_argument("--nmi-inits", type=int, default=10, help="k-means initialisations for NMI")
    p.add_argument("--curve", action="store_true",
                   help="with --eval-on val only: evaluate after every epoch (R@1, MAP@R or "
                        "accuracy in each run's history), to choose the number of epochs")
    # the kernel loss
    p.add_argument("--nngk-sigma", default="0.2",
                   help="kernel width, or 'auto': choose_sigma over --nngk-sigma-grid by the "
                        "untrained network's loss on a fixed 10%% of the training images "
                        "(also trained on afterwards; never the evaluation images)")
    p.add_argument("--nngk-sigma-grid", type=float, nargs="+",
                   default=[0.05, 0.1, 0.2, 0.3, 0.5, 1.0])
    p.add_argument("--nngk-learn-sigma", action="store_true", help="learn sigma")
    p.add_argument("--nngk-sigma-lr", type=float, default=None,
                   help="learning rate of a learned sigma (default: --lr)")
    p.add_argument("--nngk-k", type=int, default=50, help="neighbour-list length K")
    p.add_argument("--nngk-refresh-every", type=int, default=1,
                   help="full refresh (re-embed + lists) every this many epochs (0: never)")
    p.add_argument("--nngk-refresh-steps", type=int, default=None,
                   help="also a full refresh every this many steps")
    p.add_argument("--nngk-raw", action="store_true",
                   help="kernel loss on raw embeddings (default: L2-normalised)")
    p.add_argument("--nngk-fresh-centres", type=float, default=None,
                   help="write each batch's embeddings into the bank after each step, with "
                        "this momentum (0: overwrite); off when not given")
    p.add_argument("--nngk-neighbours-every-steps", type=int, default=None,
                   help="rebuild the lists from the bank every this many steps (no re-embedding)")
    p.add_argument("--nngk-warm-start-steps", type=int, default=0,
                   help="first full refresh after this many steps")
    p.add_argument("--tag", default=None,
                   help="name this variant: its runs are kept as METHOD-TAG beside the "
                        "others (ablations and search trials in one --out folder)")
    p.add_argument("--method-args", type=json.loads, default={},
                   help="JSON object of the PML loss's own keyword arguments (its documented "
                        "knobs, e.g. '{\"margin\": 0.2}'), over PML's defaults")
    p.add_argument("--nngk-learn-weights", action="store_true",
                   help="learn the per-centre weights (the longer paper's classifier)")
    p.add_argument("--nngk-weights-lr", type=float, default=1e-2,
                   help="learning rate of the learned per-centre weights")
    p.add_argument("--nngk-recalibrate", default="all",
                   help="BatchNorm statistics recalibrated before each bank embedding "
                        "(nnkloss.Refresher's recalibrate_bn): 'all' batches of the training "
                        "set, a number of batches, or 'off'")
    p.add_argument("--classify-k", type=int, default=None,
                   help="neighbours of the kernel classifier (default: --nngk-k)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is fastest on a busy 2-core machine)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    # counts (a negative --train-per-class silently dropped one image per class)
    for flag, least in (("train_per_class", 1), ("eval_per_class", 1), ("dim", 1), ("width", 1),
                        ("batch_size", 1), ("shift", 0), ("nmi_inits", 1), ("nngk_k", 1),
                        ("nngk_refresh_every", 0), ("nngk_refresh_steps", 1),
                        ("nngk_neighbours_every_steps", 1), ("nngk_warm_start_steps", 0),
                        ("classify_k", 1), ("threads", 1)):
        v = getattr(args, flag)
        if v is not None and v < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {v}")
    if args.methods is None:
        args.methods = (list(METHODS) if args.protocol == "retrieval"
                        else ["nngk", "softmax", "pixels"])
    if args.epochs is None:
        args.epochs = 1 if args.quick else 4
    if args.quick:
        args.train_per_class = args.train_per_class or 300
        args.eval_per_class = args.eval_per_class or 200
    if args.eval_per_class is None and args.eval_on == "val" and args.protocol == "retrieval":
        args.eval_per_class = 1000
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    try:  # before any data loads; "auto" becomes the device it names
        args.device = str(resolve_device(args.device))
    except (ValueError, RuntimeError) as exc:
        p.error(str(exc))
    if args.nngk_sigma != "auto":
        try:
            if not 0 < float(args.nngk_sigma) < math.inf:
                raise ValueError
        except ValueError:
            p.error(f"--nngk-sigma must be a positive number or 'auto', got {args.nngk_sigma!r}")
    if not all(0 < s < math.inf for s in args.nngk_sigma_grid):
        p.error(f"--nngk-sigma-grid must be positive numbers, got {args.nngk_sigma_grid}")
    tc = args.train_classes
    if len(set(tc)) != len(tc) or any(not 0 <= c < 10 for c in tc):
        p.error(f"--train-classes must be distinct classes in 0..9, got {tc}")
    if args.protocol == "retrieval":
        if len(tc) >= 10:
            p.error("--train-classes must leave at least one class to test on")
        if args.eval_on == "val" and not 1 <= args.val_classes <= len(tc) - 1:
            p.error(f"--val-classes must be in 1..{len(tc) - 1}, got {args.val_classes}")
    if args.curve and args.eval_on != "val":
        p.error("--curve is for choosing epochs: it needs --eval-on val (never the test images)")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    args.methods = list(dict.fromkeys(args.methods))
    if args.protocol == "classification":
        no_classifier = [m for m in args.methods if m in PML_METHODS]
        if no_classifier:
            p.error(f"--protocol classification has a classifier for nngk, softmax and pixels "
                    f"only, not --methods {' '.join(no_classifier)}")
    if args.tag is not None and (not args.tag or not all(c.isalnum() or c in "._" for c in
                                                         args.tag)):
        p.error(f"--tag must be letters, digits, '.' or '_', got {args.tag!r}")
    if not isinstance(args.method_args, dict):
        p.error(f"--method-args must be a JSON object, got {args.method_args!r}")
    if args.method_args and any(m not in PML_METHODS for m in args.methods):
        p.error("--method-args are a PML loss's: give them with one PML method")
    try:
        args.nngk_recalibrate = {"all": True, "off": False}.get(args.nngk_recalibrate) \
            if args.nngk_recalibrate in ("all", "off") else int(args.nngk_recalibrate)
        if args.nngk_recalibrate is not True and args.nngk_recalibrate is not False \
                and args.nngk_recalibrate < 1:
            raise ValueError
    except ValueError:
        p.error(f"--nngk-recalibrate must be 'all', 'off' or a number of batches >= 1, got "
                f"{args.nngk_recalibrate!r}")
    return args


def run_name(method: str, args) -> str:
    """The name a method's runs are kept and reported under (variants: METHOD-TAG)."""
    return f"{method}-{args.tag}" if args.tag else method


# ---------------------------------------------------------------------------- data
class Augment:
    """Random shift by up to ``shift`` pixels (zero fill) and random horizontal flip of a
    (1, H, W) image. Draws from torch's global RNG, which the Trainer reseeds per epoch."""

    def __init__(self, shift: int, flip: bool):
        self.shift, self.flip = int(shift), bool(flip)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if self.flip and bool(torch.rand(()) < 0.5):
            img = img.flip(-1)
        m = self.shift
        if m:
            h, w = img.shape[-2:]
            padded = nn.functional.pad(img, (m, m, m, m))
            dy, dx = torch.randint(0, 2 * m + 1, (2,)).tolist()
            img = padded[..., dy:dy + h, dx:dx + w]
        return img


def _limit(labels: torch.Tensor, per_class: Optional[int]) -> np.ndarray:
    """Positions of at most ``per_class`` items of each class (seed 0: the same for all runs)."""
    lab = labels.numpy()
    if per_class is None:
        return np.arange(len(lab))
    rng = np.random.default_rng(0)
    keep = [rng.permutation(np.flatnonzero(lab == c))[:per_class] for c in np.unique(lab)]
    return np.sort(np.concatenate(keep))


def load_data(args) -> Dict:
    """The training set (raw images + labels) and the evaluation set of the protocol.

    Returns {"train_x", "train_y", "eval_x", "eval_y", "train_classes", "eval_classes",
    "files", "split"} with x (N, 1, 28, 28) float32 in [0, 1] and y 0..C-1.
    """
    root, tc = args.data_root, list(args.train_classes)
    if args.protocol == "retrieval":
        if args.eval_on == "test":
            fit_cls, eval_cls = tc, [c for c in range(10) if c not in tc]
            tr = IDXDataset(root, "train", fit_cls)
            ev = IDXDataset(root, "test", eval_cls)
            split = "test images of the other classes"
        else:
            fit_cls, eval_cls = tc[:-args.val_classes], tc[-args.val_classes:]
            tr = IDXDataset(root, "train", fit_cls)
            ev = IDXDataset(root, "train", eval_cls)
            split = "training images of held-out train classes (validation)"
        tx, ty, ex, ey = tr.inputs, tr.labels, ev.inputs, ev.labels
        files = list(tr.files) + list(ev.files)
    else:
        fit_cls = eval_cls = list(range(10))
        tr = IDXDataset(root, "train")
        files = list(tr.files)
        if args.eval_on == "test":
            ev = IDXDataset(root, "test")
            tx, ty, ex, ey = tr.inputs, tr.labels, ev.inputs, ev.labels
            files += list(ev.files)
            split = "official test images"
        else:
            fit, val = stratified_split(tr.labels.numpy(), (1 - args.val_fraction,
                                                            args.val_fraction), seed=0)
            tx, ty, ex, ey = tr.inputs[fit], tr.labels[fit], tr.inputs[val], tr.labels[val]
            split = f"{args.val_fraction:.0%} of the training images (validation)"
    keep = _limit(ty, args.train_per_class)
    tx, ty = tx[keep], ty[keep]
    keep = _limit(ey, args.eval_per_class)
    ex, ey = ex[keep], ey[keep]
    return {"train_x": tx, "train_y": ty, "eval_x": ex, "eval_y": ey,
            "train_classes": fit_cls, "eval_classes": eval_cls, "files": files, "split": split}


# ---------------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    """Three conv(3x3)-BN-ReLU-maxpool blocks (width, 2 width, 4 width channels; 28 -> 14 -> 7
    -> 3) and a linear layer to ``dim``. ``normalise``: L2-normalise the output.
    ``forward(x)``: (B, 1, 28, 28) float32 -> (B, dim) float32."""

    def __init__(self, dim: int = 64, width: int = 16, normalise: bool = False):
        super().__init__()

        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o),
                    nn.ReLU(inplace=True), nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(1, width), *block(width, 2 * width),
                                      *block(2 * width, 4 * width), nn.Flatten())
        self.fc = nn.Linear(4 * width * 9, dim)
        self.normalise = bool(normalise)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.fc(self.features(x))
        return nn.functional.normalize(e, dim=1) if self.normalise else e


class PMLCriterion(nn.Module):
    """A pytorch-metric-learning loss (and optional miner) with the Trainer's call signature
    ``criterion(emb, labels, idx) -> 0-dim loss`` (``idx`` is ignored)."""

    def __init__(self, loss: nn.Module, miner: Optional[nn.Module] = None):
        super().__init__()
        self.loss, self.miner = loss, miner

    def forward(self, emb, labels, idx=None):
        pairs = self.miner(emb, labels) if self.miner is not None else None
        return self.loss(emb, labels, pairs)


def pml_criterion(method: str, num_classes: int, dim: int, loss_args=None) -> PMLCriterion:
    """PML's standard settings (its defaults; triplet: margin 0.2 for loss and miner, as in
    PML's examples), with ``loss_args`` (the loss's own knobs) over them."""
    from pytorch_metric_learning import losses, miners

    kw = dict(loss_args or {})
    if method == "contrastive":
        return PMLCriterion(losses.ContrastiveLoss(**kw))
    if method == "triplet":
        return PMLCriterion(losses.TripletMarginLoss(**{"margin": 0.2, **kw}),
                            miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard"))
    if method == "multisimilarity":
        return PMLCriterion(losses.MultiSimilarityLoss(**kw), miners.MultiSimilarityMiner())
    if method == "nca":
        return PMLCriterion(losses.NCALoss(**kw))
    if method == "proxyanchor":
        return PMLCriterion(losses.ProxyAnchorLoss(num_classes, dim, **kw))
    if method == "normsoftmax":
        return PMLCriterion(losses.NormalizedSoftmaxLoss(num_classes, dim, **kw))
    if method == "arcface":
        return PMLCriterion(losses.ArcFaceLoss(num_classes, dim, **kw))
    raise ValueError(f"not a PML method: {method!r}")


def pml_settings(method: str, loss_args=None) -> Dict:
    """The settings recorded in results.json (what :func:`pml_criterion` builds)."""
    import pytorch_metric_learning as pml
    from pytorch_metric_learning import losses

    loss_cls = {"contrastive": losses.ContrastiveLoss, "triplet": losses.TripletMarginLoss,
                "multisimilarity": losses.MultiSimilarityLoss, "nca": losses.NCALoss,
                "proxyanchor": losses.ProxyAnchorLoss,
                "normsoftmax": losses.NormalizedSoftmaxLoss, "arcface": losses.ArcFaceLoss}[method]
    defaults = {k: v.default for k, v in inspect.signature(loss_cls.__init__).parameters.items()
                if v.default is not inspect.Parameter.empty and k != "kwargs"}
    out = {"pml_version": pml.__version__, "loss": loss_cls.__name__, "loss_args": defaults}
    if method == "triplet":
        out["loss_args"]["margin"] = 0.2
    out["loss_args"].update(loss_args or {})
    if method == "triplet":
        out["miner"] = "TripletMarginMiner"
        out["miner_args"] = {"margin": 0.2, "type_of_triplets": "semihard"}
    elif method == "multisimilarity":
        out["miner"] = "MultiSimilarityMiner"
        out["miner_args"] = {"epsilon": 0.1}
    return out


# ---------------------------------------------------------------------------- configuration
def common_config(args, data) -> Dict:
    return {"format": RUN_FORMAT, "protocol": args.protocol, "eval_on": args.eval_on,
            "eval_split": data["split"], "train_classes": data["train_classes"],
            "eval_classes": data["eval_classes"], "train_images": len(data["train_y"]),
            "eval_images": len(data["eval_y"]), "train_per_class": args.train_per_class,
            "eval_per_class": args.eval_per_class, "epochs": args.epochs,
            "network": f"SmallCNN(width={args.width}, dim={args.dim})",
            "memory_format": args.memory_format,
            "optimizer": "adamw", "lr": args.lr, "weight_decay": args.weight_decay,
            "batch_size": args.batch_size, "drop_last": True,
            "augmentation": {"shift": args.shift, "hflip": not args.no_flip},
            "nmi_inits": args.nmi_inits, "threads": args.threads, "curve": args.curve}


def method_config(method: str, args, data) -> Dict:
    cfg = common_config(args, data)
    cfg["method"] = method
    if method == "pixels":
        for k in ("epochs", "network", "memory_format", "optimizer", "lr", "weight_decay",
                  "batch_size", "drop_last", "augmentation", "threads"):
            cfg.pop(k)
        cfg["embedding"] = "raw pixels (784-d)"
        if args.protocol == "classification":
            cfg["classifier"] = "1-nearest neighbour"
    elif method == "nngk":
        cfg["nngk"] = {"sigma": args.nngk_sigma, "learn_sigma": args.nngk_learn_sigma,
                       "sigma_lr": args.nngk_sigma_lr, "k": args.nngk_k,
                       "refresh_every_epochs": args.nngk_refresh_every,
                       "refresh_every_steps": args.nngk_refresh_steps,
                       "normalised": not args.nngk_raw,
                       "fresh_centres": args.nngk_fresh_centres,
                       "neighbours_every_steps": args.nngk_neighbours_every_steps,
                       "warm_start_steps": args.nngk_warm_start_steps,
                       "ensure_positive": True,
                       "learn_weights": args.nngk_learn_weights,
                       "recalibrate_bn": args.nngk_recalibrate}
        if args.nngk_learn_weights:
            cfg["nngk"]["weights_lr"] = args.nngk_weights_lr
        if args.nngk_sigma == "auto":
            cfg["nngk"]["sigma_grid"] = list(args.nngk_sigma_grid)
        if args.protocol == "classification":
            cfg["nngk"]["classify_k"] = args.classify_k or args.nngk_k
        cfg["eval_normalised"] = not args.nngk_raw
    elif method == "softmax":
        cfg["eval_normalised"] = False
    else:
        cfg["pml"] = pml_settings(method, args.method_args)
        cfg["eval_normalised"] = True  # PML's losses compare L2-normalised embeddings
        if method in PROXY_METHODS:
            cfg["loss_lr"] = args.loss_lr
    return cfg


# ---------------------------------------------------------------------------- evaluation
def retrieval_scores(emb: torch.Tensor, labels: torch.Tensor, seed: int, n_init: int
                     ) -> Dict[str, float]:
    # One search feeds Recall@K and MAP@R; NMI is k-means with n_init initialisations.
    scores = M.evaluate(emb, labels, ks=RECALL_KS)
    out = {f"recall@{k}": float(scores[f"recall@{k}"]) for k in RECALL_KS}
    out["map@r"] = float(scores["map@r"])
    out["nmi"] = float(M.nmi(emb, labels, seed=seed, n_init=n_init))
    return out


# ---------------------------------------------------------------------------- one run
def _load() -> List[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def _loader(ds, batch_size, shuffle, drop_last=False):
    # The training loader (shuffle) draws from torch's global RNG, which the Trainer reseeds per
    # epoch: every method then sees the same batches and the same augmentation draws. An
    # ordered (inference) loader gets a generator of its own: every iter() of a DataLoader
    # draws its base seed from its generator, the global RNG when it has none, so a bank
    # refresh inside an epoch (NNGK's warm start, --nngk-refresh-steps) shifted the
    # augmentation draws of every later batch of that epoch away from the other methods'.
    gen = None if shuffle else torch.Generator()
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                      generator=gen)


def _trainer_accepts(*names: str) -> bool:
    params = inspect.signature(Trainer.__init__).parameters
    return all(n in params for n in names)


def train_and_evaluate(method: str, seed: int, data: Dict, args, cfg: Dict, run_dir: str
                       ) -> Dict:
    """Train one (method, seed) and evaluate it; returns the run's record."""
    device = torch.device(args.device)
    n_classes = len(data["train_classes"])
    tx, ty, ex, ey = data["train_x"], data["train_y"], data["eval_x"], data["eval_y"]
    record = {"method": method, "seed": seed, "config": cfg}
    t0 = time.perf_counter()
    load_start = _load()
    if method == "pixels":
        if args.protocol == "retrieval":
            metrics = retrieval_scores(ex.flatten(1), ey, seed, args.nmi_inits)
        else:
            metrics = {"accuracy": nearest_neighbour_accuracy(tx.flatten(1), ty,
                                                              ex.flatten(1), ey)}
        record.update(metrics=metrics, train_time_s=0.0,
                      eval_time_s=time.perf_counter() - t0, history=[])
        record.update(wall_s=record["eval_time_s"], load_start=load_start, load_end=_load())
        return record

    seed_everything(seed)  # the same initial network for every method of a seed
    normalise = method == "nngk" and not args.nngk_raw
    model = SmallCNN(args.dim, args.width, normalise=normalise)
    if args.memory_format == "channels_last":
        # Same weights (the format changes strides only); convolutions and pooling then keep
        # activations channels-innermost, whatever the input's format.
        model = model.to(memory_format=torch.channels_last)
    aug = Augment(args.shift, not args.no_flip)
    train_loader = _loader(IndexedTensorDataset(tx, ty, transform=aug), args.batch_size,
                           shuffle=True, drop_last=True)
    plain_train = _loader(IndexedTensorDataset(tx, ty), INFERENCE_BATCH, shuffle=False)
    eval_loader = _loader(IndexedTensorDataset(ex, ey), INFERENCE_BATCH, shuffle=False)
    kw = dict(device=device, optimizer="adamw", lr=args.lr, weight_decay=args.weight_decay,
              out_dir=run_dir, seed=seed, progress=not args.no_progress,
              desc=f"{method} s{seed}", checkpoint_every=1)
    extra: Dict = {}
    if args.curve:
        kw["eval_fn"] = _curve_fn(args, plain_train, eval_loader, cfg, device)
    if method == "nngk":
        sigma = 1.0 if args.nngk_sigma == "auto" else float(args.nngk_sigma)
        criterion, refresher = kernel_criterion(
            model, plain_train, ty, args.dim, sigma, args.nngk_k, device,
            learn_sigma=args.nngk_learn_sigma, ensure_positive=True, progress=False,
            learn_weights=args.nngk_learn_weights, recalibrate_bn=args.nngk_recalibrate)
        if args.nngk_sigma == "auto":
            sigma, losses = choose_sigma_for(model, criterion, refresher, data, args, device)
            extra["sigma_search"] = {"candidates": list(args.nngk_sigma_grid),
                                     "loss": losses, "chosen": sigma}
        options = {}
        if args.nngk_fresh_centres is not None:
            options["fresh_centres"] = args.nngk_fresh_centres
        if args.nngk_neighbours_every_steps is not None:
            options["neighbours_every_steps"] = args.nngk_neighbours_every_steps
        if args.nngk_warm_start_steps:
            options["warm_start_steps"] = args.nngk_warm_start_steps
        if options and not _trainer_accepts(*options):
            raise SystemExit(f"this checkout's Trainer lacks the options {sorted(options)} "
                             "(the NNGK options of issue 20)")
        every = args.nngk_refresh_every or None
        schedule = RefreshSchedule(every_epochs=every, every_steps=args.nngk_refresh_steps)
        trainer = Trainer(model, criterion, train_loader, refresher=refresher,
                          schedule=schedule, sigma_lr=args.nngk_sigma_lr,
                          weights_lr=args.nngk_weights_lr, **options, **kw)
    elif method == "softmax":
        criterion = SoftmaxHead(args.dim, n_classes)
        trainer = Trainer(model, criterion, train_loader, **kw)
    else:
        criterion = pml_criterion(method, n_classes, args.dim, args.method_args)
        trainer = Trainer(model, criterion, train_loader, **kw)
        if method in PROXY_METHODS:
            # The losses' own parameters: same optimiser, their own learning rate (PML's docs
            # train them with a separate optimiser at lr 0.01; Proxy Anchor uses 100x the
            # network's). No weight decay on them.
            loss_params = list(criterion.parameters())
            ids = {id(p) for p in loss_params}
            net = [p for p in model.parameters() if id(p) not in ids]
            trainer.optimizer = torch.optim.AdamW(
                [{"params": net, "lr": args.lr, "weight_decay": args.weight_decay,
                  "name": "network"},
                 {"params": loss_params, "lr": args.loss_lr, "weight_decay": 0.0,
                  "name": "loss"}], lr=args.lr)
    # An interrupted run resumes from its last epoch checkpoint: this process then times only
    # the epochs after it (a run killed after its last checkpoint but before its result.json
    # "trained" in ~0 s). Its time is unknown, not that of a whole run: the timings are
    # recorded as None (the method's time in the summary then shows "-"), the part timed here
    # beside them.
    resumed_from = 0
    if os.path.isfile(trainer.checkpoint_path):
        trainer.load_checkpoint()
        resumed_from = trainer.epoch
    t_train = time.perf_counter()
    trainer.fit(args.epochs, resume=False)  # the checkpoint, if any, is loaded above
    train_time = time.perf_counter() - t_train
    t_eval = time.perf_counter()
    model.eval()
    if args.protocol == "retrieval":
        emb, lab = extract_embeddings(model, eval_loader, device)
        if cfg.get("eval_normalised"):
            emb = nn.functional.normalize(emb, dim=1)
        metrics = retrieval_scores(emb, lab, seed, args.nmi_inits)
    else:
        k = args.classify_k or args.nngk_k
        metrics = classification_metrics(model, trainer.criterion, plain_train, eval_loader,
                                         k=k, device=device)
        metrics = {"accuracy": metrics["accuracy"], "nll": metrics["loss"]}
    if method == "nngk":
        metrics["final_sigma"] = trainer.criterion.kernel_sigma()
    record.update(extra)
    record.update(metrics=metrics, train_time_s=train_time,
                  eval_time_s=time.perf_counter() - t_eval, wall_s=time.perf_counter() - t0,
                  history=trainer.history, load_start=load_start, load_end=_load())
    if resumed_from:
        record.update(resumed_from_epoch=resumed_from,
                      train_time_this_process_s=record["train_time_s"],
                      wall_this_process_s=record["wall_s"], train_time_s=None, wall_s=None)
    return record


def _curve_fn(args, plain_train, eval_loader, cfg, device):
    """eval_fn of the Trainer for --curve: validation metrics after each epoch."""
    def fn(model, criterion, epoch):
        if args.protocol == "retrieval":
            emb, lab = extract_embeddings(model, eval_loader, device)
            if cfg.get("eval_normalised"):
                emb = nn.functional.normalize(emb, dim=1)
            return {"val_recall@1": M.recall_at_k(emb, lab, (1,))[1],
                    "val_map@r": M.map_at_r(emb, lab)}
        k = args.classify_k or args.nngk_k
        return {"val_accuracy": classification_metrics(model, criterion, plain_train,
                                                       eval_loader, k=k,
                                                       device=device)["accuracy"]}
    return fn


def choose_sigma_for(model, criterion, refresher, data, args, device):
    """sigma by the untrained network's loss on a fixed 10% of the training images (never the
    evaluation set), before training: nnkloss.experiment.choose_sigma over --nngk-sigma-grid.
    The sample is not held out: those images are trained on afterwards like the rest (the
    published runs chose their sigma this way; the choice is made before any training)."""
    try:
        from nnkloss.experiment import choose_sigma
    except ImportError:
        raise SystemExit("--nngk-sigma auto needs nnkloss.experiment.choose_sigma "
                         "(the NNGK options of issue 20)") from None
    tx, ty = data["train_x"], data["train_y"]
    refresher.refresh()  # the untrained network's bank: what the first steps train against
    # A fixed 10% of the training images (seed 0) as the sample, not held out: the training
    # loader still holds them (the choice is made before training, by the untrained network).
    _, held = stratified_split(ty.numpy(), (0.9, 0.1), seed=0)
    held = torch.from_numpy(held)
    loader = DataLoader(_Rows(IndexedTensorDataset(tx, ty), held), batch_size=512)
    best, losses = choose_sigma(model, criterion, loader, list(args.nngk_sigma_grid), device)
    with torch.no_grad():  # the Refresher reads the loss's current sigma
        criterion.log_sigma.fill_(math.log(float(best)))
    return float(best), {str(k): float(v) for k, v in losses.items()}


class _Rows(torch.utils.data.Dataset):
    """Items ``rows`` of a (x, y, idx) dataset, keeping their original idx (bank rows)."""

    def __init__(self, ds, rows):
        self.ds, self.rows = ds, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.ds[int(self.rows[i])]


# ---------------------------------------------------------------------------- summary
def _mean_std(values: List[float]):
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _stored_runs(out_dir: str) -> List[Dict]:
    recs = []
    root = os.path.join(out_dir, "runs")
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, d, "result.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            # only this script's records (a damaged or foreign one is left out of the report)
            if (isinstance(rec, dict) and isinstance(rec.get("config"), dict)
                    and isinstance(rec.get("method"), str) and isinstance(rec.get("seed"), int)
                    and isinstance(rec.get("metrics"), dict)):
                recs.append(rec)
    return recs


def _order(name: str):
    """Report order: the METHODS order, NNGK variants beside nngk."""
    base = "nngk" if name.startswith("nngk") else name
    return (METHODS.index(base) if base in METHODS else len(METHODS), name)


def summarise(runs: Dict[str, Dict], methods: Sequence[str], keys: Sequence[str]) -> Dict:
    """{name: {"seeds": [...], key: {"mean", "std"}, "train_time_s": {...}}} over seeds."""
    out = {}
    for m in methods:
        rs = [r for r in runs.values() if r.get("name", r["method"]) == m]
        if not rs:
            continue
        s = {"seeds": sorted(r["seed"] for r in rs)}
        for key in list(keys) + ["train_time_s", "wall_s"]:
            # Every run of the name or none: a mean over the runs that happen to hold a value
            # would sit beside "seeds" naming them all (a run without it, e.g. a resumed run's
            # unknown time, left the others' mean as the method's).
            vals = [r["metrics"].get(key, r.get(key)) for r in rs]
            if all(v is not None for v in vals):
                mean, std = _mean_std(vals)
                s[key] = {"mean": mean, "std": std}
        out[m] = s
    return out


def _pm(entry, scale=100.0, digits=2) -> str:
    if entry is None:
        return "-"
    return f"{scale * entry['mean']:.{digits}f} ± {scale * entry['std']:.{digits}f}"


def table_rows(summary: Dict, keys: Sequence[str]) -> List[List[str]]:
    rows = []
    for m, s in summary.items():
        rows.append([m, str(len(s["seeds"]))] + [_pm(s.get(k)) for k in keys]
                    + [_pm(s.get("train_time_s"), 1.0, 0)])
    return rows


def write_csv(path: str, summary: Dict, keys: Sequence[str]) -> None:
    sio = io.StringIO()
    w = csv.writer(sio, lineterminator="\n")
    cols = list(keys) + ["train_time_s"]
    w.writerow(["method", "seeds"] + [f"{k}_{s}" for k in cols for s in ("mean", "std")])
    for m, s in summary.items():
        w.writerow([m, len(s["seeds"])] + [f"{s[k][st]:.6g}" if k in s else ""
                                           for k in cols for st in ("mean", "std")])
    atomic_write(path, sio.getvalue().encode("utf-8"))


def plot(summary: Dict, path: str, protocol: str, title: str) -> str:
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if protocol == "retrieval":
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5),
                                     gridspec_kw={"width_ratios": [3, 2]})
        names = list(summary)
        for i, m in enumerate(names):
            s = summary[m]
            mean = [100 * s[f"recall@{k}"]["mean"] for k in RECALL_KS]
            std = [100 * s[f"recall@{k}"]["std"] for k in RECALL_KS]
            # a small x offset per method keeps the error bars apart
            xs = [k * 2 ** ((i - len(names) / 2) * 0.02) for k in RECALL_KS]
            ax.errorbar(xs, mean, yerr=std, marker="o", capsize=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(RECALL_KS)
        ax.set_xticklabels([str(k) for k in RECALL_KS])
        ax.set_xlabel("K")
        ax.set_ylabel("Recall@K (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(title)
        mean = [100 * summary[m]["map@r"]["mean"] for m in names]
        std = [100 * summary[m]["map@r"]["std"] for m in names]
        bx.barh(names, mean, xerr=std, capsize=3, color="tab:blue")
        bx.invert_yaxis()
        bx.set_xlabel("MAP@R (%), mean ± std over seeds")
        bx.grid(True, axis="x", alpha=0.3)
    else:
        fig, bx = plt.subplots(figsize=(6, 3.5))
        names = list(summary)
        mean = [100 * summary[m]["accuracy"]["mean"] for m in names]
        std = [100 * summary[m]["accuracy"]["std"] for m in names]
        bx.barh(names, mean, xerr=std, capsize=3, color="tab:green")
        bx.invert_yaxis()
        bx.set_xlim(max(0.0, min(mean) - 10), 100)
        bx.set_xlabel("test accuracy (%), mean ± std over seeds")
        bx.set_title(title)
        bx.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return path


# ---------------------------------------------------------------------------- main
def _same_config(path: str, cfg: Dict) -> Optional[Dict]:
    """The stored record at ``path`` if it was made with configuration ``cfg``."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    # a record of another shape (damaged, or not this script's) is not this run's: run it again
    same = isinstance(rec, dict) and rec.get("config") == json.loads(json.dumps(cfg))
    return rec if same else None


SUPERSEDED = "superseded"


def _supersede(out_dir: str, run_dir: str) -> str:
    """Move a run of another configuration out of ``runs/`` into ``superseded/`` instead of
    deleting it: the record of what was tried (a search candidate, or a configuration run on
    the test images and then replaced) stays, and results.json lists it. Its checkpoint goes
    (the bulk of the folder, an NNGK bank with its lists; nothing resumes from it)."""
    root = os.path.join(out_dir, SUPERSEDED)
    os.makedirs(root, exist_ok=True)
    base = os.path.basename(run_dir.rstrip(os.sep))
    n = 1
    while os.path.exists(os.path.join(root, f"{base}.{n}")):
        n += 1
    dest = os.path.join(root, f"{base}.{n}")
    os.replace(run_dir, dest)
    ckpt = os.path.join(dest, "checkpoint.pt")
    if os.path.isfile(ckpt):
        os.remove(ckpt)
    return dest


def _superseded_runs(out_dir: str) -> List[Dict]:
    """What each superseded run folder holds: its configuration, and its metrics and times
    where it finished (None where it was stopped before its result.json)."""
    out = []
    root = os.path.join(out_dir, SUPERSEDED)
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        entry = {"folder": os.path.join(SUPERSEDED, d), "config": None, "metrics": None}
        for fname in ("config.json", "result.json"):
            try:
                with open(os.path.join(root, d, fname), encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(rec, dict):
                continue
            entry["config"] = rec.get("config", entry["config"])
            if fname == "result.json":
                for k in ("name", "method", "seed", "metrics", "train_time_s", "wall_s",
                          "finished", "commit", "sigma_search"):
                    if k in rec:
                        entry[k] = rec[k]
        out.append(entry)
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    # the code this invocation runs: its runs and its results are labelled with it
    commit = git_commit(os.path.dirname(os.path.abspath(__file__)))
    data = load_data(args)
    # torch's optimisers import torch._dynamo on their first construction (0.9 s on the 2-core
    # AMD EPYC family 26): imported here, so that the first run's wall time does not carry a
    # cost of the process that the runs after it never pay.
    importlib.import_module("torch._dynamo")
    keys = RETRIEVAL_KEYS if args.protocol == "retrieval" else ("accuracy",)
    runs: Dict[str, Dict] = {}
    todo = [(m, s) for m in args.methods for s in args.seeds]
    from tqdm.auto import tqdm
    bar = tqdm(todo, desc="fashion-mnist runs", disable=args.no_progress, unit="run")
    skipped = 0
    for method, seed in bar:
        name = run_name(method, args)
        bar.set_postfix(run=f"{name} s{seed}")
        cfg = method_config(method, args, data)
        run_dir = os.path.join(args.out, "runs", f"{name}-s{seed}")
        rec_path = os.path.join(run_dir, "result.json")
        rec = _same_config(rec_path, cfg)
        if rec is not None:
            skipped += 1
        else:
            # A run directory of another configuration (or none) starts afresh; one of this
            # configuration keeps its checkpoint, so an interrupted run resumes mid-way.
            cfg_path = os.path.join(run_dir, "config.json")
            if os.path.isdir(run_dir) and _same_config(cfg_path, cfg) is None:
                _supersede(args.out, run_dir)
            os.makedirs(run_dir, exist_ok=True)
            write_json(cfg_path, {"config": cfg})
            rec = train_and_evaluate(method, seed, data, args, cfg, run_dir)
            rec["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            rec["commit"] = commit
            rec["name"] = name
            write_json(rec_path, json.loads(json.dumps(rec, default=float)))
        rec["name"] = name
        runs[f"{name}/s{seed}"] = rec
    bar.close()
    # Runs of other invocations into this folder with the same shared set-up (e.g. NNGK
    # variants under --tag, or other methods) are reported beside these.
    # One name's seeds are one configuration: a stored run of another configuration under
    # the same name (say seed 1 of an earlier --nngk-sigma, beside this invocation's seed 0)
    # is left out. This invocation's names keep its configuration; another name, that of its
    # newest run.
    shared = common_config(args, data)
    names = [run_name(m, args) for m in args.methods]
    stored = _stored_runs(args.out)
    name_cfg = {run_name(m, args): json.loads(json.dumps(method_config(m, args, data)))
                for m in args.methods}
    for rec in sorted(stored, key=lambda r: str(r.get("finished", "")), reverse=True):
        name_cfg.setdefault(rec.get("name", rec["method"]), rec["config"])
    for rec in stored:
        nm = rec.get("name", rec["method"])
        key = f"{nm}/s{rec['seed']}"
        if key not in runs and rec["config"] == name_cfg[nm] and all(
                rec["config"].get(k) == v for k, v in json.loads(json.dumps(shared)).items()
                if k in rec["config"]):
            runs[key] = rec
            if nm not in names:
                names.append(nm)
    own = len(args.methods)
    names = names[:own] + sorted(names[own:], key=_order)
    summary = summarise(runs, names, keys)
    results = {
        "format": RUN_FORMAT,
        "protocol": args.protocol,
        "eval_on": args.eval_on,
        "config": common_config(args, data),
        "data_files": data["files"],
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": args.device, "load_at_end": _load()},
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs_skipped_as_done": skipped,
        "total_wall_s_this_invocation": time.perf_counter() - t_start,
        "summary": summary,
        "runs": runs,
        # runs replaced by another configuration under their name: not in the summary, kept
        # as the record of what was tried
        "superseded": _superseded_runs(args.out),
    }
    write_json(os.path.join(args.out, "results.json"), json.loads(json.dumps(results,
                                                                            default=float)))
    write_csv(os.path.join(args.out, "summary.csv"), summary, keys)
    heads = {"recall@1": "R@1", "recall@2": "R@2", "recall@4": "R@4", "recall@8": "R@8",
             "map@r": "MAP@R", "nmi": "NMI", "accuracy": "accuracy"}
    where = data["split"]
    title = (f"Fashion-MNIST {args.protocol}, trained on classes {data['train_classes']}, "
             f"evaluated on {where} (classes {data['eval_classes']}), {args.epochs} epochs, "
             f"mean ± std over seeds")
    table = markdown_table(["method", "seeds"] + [heads[k] for k in keys] + ["train s"],
                           table_rows(summary, keys), title=title)
    write_table(os.path.join(args.out, "results.md"), table)
    name = "recall.png" if args.protocol == "retrieval" else "accuracy.png"
    # The picture shows this invocation's NNGK variant only (the table has every variant).
    shown = {m: s for m, s in summary.items()
             if not m.startswith("nngk-") or m == run_name("nngk", args)}
    plot(shown, os.path.join(args.out, name), args.protocol,
         f"Fashion-MNIST {args.protocol} ({args.eval_on}), {args.epochs} epoch(s)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
