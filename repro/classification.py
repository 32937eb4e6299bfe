"""Tables 2-4 of Meyer et al. (the longer version): the kernel classifier vs softmax on
CUB-200-2011, Stanford Cars196, Oxford 102 Flowers and Leafsnap (field images).

    python repro/classification.py --dataset cub --data-root /data/CUB_200_2011 \\
        --arch vgg16 --pretrained /weights/vgg16-397923af.pth --out results/cls_cub_vgg16

Protocol (the papers): the same classes for training and testing; bounding-box crops for CUB
and Cars; validation splits: 20% of the CUB training set, 30% of the Cars training set
(seeded, per class), the official Flowers split, a seeded per-species 50/20/30 split of the
Leafsnap field images. Embedding: FC7 (4096-d, without its ReLU, with dropout) for AlexNet and
VGG16, the final pooling (2048-d, followed by dropout) for ResNet50; torchvision models with
``weights=None`` and ImageNet weights only from ``--pretrained`` (a local state dict).
The kernel loss learns the per-centre weights (as in the papers); the classifier at test time
is Eq. 3 over the bank of training embeddings with the learned weights, K nearest centres.

Paper defaults: batch 20, SGD, update interval 10 epochs, lr 1e-5 for the kernel loss, sigma
100 for 4096-d embeddings (scaled with sqrt(dim) for ResNet50's 2048-d: ~71), K = 100. Not
given in the papers (so our choices, all flags): the softmax learning rate (1e-4), the
learning rate of the per-centre weights (1e-3), momentum 0.9, weight decay 5e-4 and 60
epochs. The papers choose hyper-parameters by validation loss; results.json reports the
validation loss and accuracy next to the test accuracy for that purpose.

Outputs: ``OUT/<loss>/`` (log, checkpoint, training curves; rerunning resumes unless
--restart), ``OUT/results.json`` ({"dataset", "arch", "runs": {loss: {"val_accuracy",
"val_loss", "test_accuracy", ...}}, "paper": ...}; fractions in [0, 1]) and ``OUT/results.md``.
Several GPUs: ``torchrun --nproc-per-node G repro/classification.py ...`` (one process per GPU;
``--batch-size`` stays the global batch and must be a multiple of G; only rank 0 writes files;
see :mod:`nnkloss.distributed`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, Optional, Sequence

import torch

from nnkloss import distributed as nkd
from nnkloss.experiment.datasets import CUB200, Cars196, Flowers102, Leafsnap, as_tensor_labels
from nnkloss.experiment.evaluate import classification_metrics
from nnkloss.experiment.setup import (HelpFormatter, check_epochs, check_resume, image_transforms,
                                      kernel_criterion, make_loader, run_settings, start_run)
from nnkloss.experiment.models import MIN_IMAGE_SIZE, SoftmaxHead, build_embedding_net
from nnkloss.bank.refresh import RefreshSchedule
from nnkloss.experiment.plots import plot_training_curves
from nnkloss.experiment.reporting import markdown_table, percent, write_json, write_table
from nnkloss.experiment.seeds import seed_arg
from nnkloss.experiment.train import Trainer, seed_everything

DATASETS = {"cub": CUB200, "cars": Cars196, "flowers": Flowers102, "leafsnap": Leafsnap}
NAMES = {"cub": "Birds200 (CUB-200-2011)", "cars": "Stanford Cars196",
         "flowers": "Oxford 102 Flowers", "leafsnap": "Leafsnap field"}
FEATURE_DIM = {"alexnet": 4096, "vgg16": 4096, "resnet50": 2048}
LOSSES = ("nngk", "softmax")

# The papers' test accuracies in % (softmax, ours): Table 2 (CUB, three networks) and
# Table 4 (VGG16 on the other datasets).
PAPER = {
    ("cub", "alexnet"): (62.41, 66.95), ("cub", "vgg16"): (75.37, 78.63),
    ("cub", "resnet50"): (78.05, 78.98), ("flowers", "vgg16"): (82.79, 86.26),
    ("cars", "vgg16"): (85.67, 86.52), ("leafsnap", "vgg16"): (73.80, 75.96),
}


def default_sigma(arch: str) -> float:
    """100 for the 4096-d FC7 embeddings (the papers, VGG16 on CUB); scaled by sqrt(dim/4096)
    otherwise, since typical distances grow like the square root of the dimension."""
    return 100.0 * math.sqrt(FEATURE_DIM[arch] / 4096.0)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS))
    p.add_argument("--data-root", required=True, help="the dataset's folder (official layout)")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="vgg16", choices=sorted(FEATURE_DIM))
    p.add_argument("--loss", nargs="+", default=list(LOSSES), choices=LOSSES,
                   help="which losses to train (one run each)")
    p.add_argument("--pretrained", default=None,
                   help="local torchvision state dict of --arch (e.g. ImageNet weights)")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate, kernel loss")
    p.add_argument("--softmax-lr", type=float, default=1e-4, help="learning rate, softmax")
    p.add_argument("--weights-lr", type=float, default=1e-3,
                   help="learning rate of the learned per-centre weights")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--dropout", type=float, default=0.5, help="dropout on the embedding")
    p.add_argument("--sigma", type=float, default=None,
                   help="kernel width (default 100 for 4096-d, ~71 for ResNet50's 2048-d)")
    p.add_argument("--k", type=int, default=100, help="neighbours (training lists and test)")
    p.add_argument("--update-interval", type=int, default=10,
                   help="epochs between bank refreshes")
    p.add_argument("--fixed-weights", action="store_true",
                   help="keep the per-centre weights at 1 (the papers' ablation)")
    p.add_argument("--no-bbox", action="store_true",
                   help="do not crop CUB/Cars images to their bounding boxes")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="held-out part of the official training set (CUB 0.2, Cars 0.3)")
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", action="store_true", help="mixed precision (CUDA only)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--eval-every", type=int, default=0,
                   help="also log validation accuracy/loss every N epochs (0: at the end)")
    p.add_argument("--seed", type=seed_arg, default=0, help="training seed and split seed")
    p.add_argument("--restart", action="store_true",
                   help="train afresh: remove the runs' old checkpoints first")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.image_size < MIN_IMAGE_SIZE[args.arch]:
        p.error(f"--image-size must be >= {MIN_IMAGE_SIZE[args.arch]} for {args.arch}")
    return args


def load_splits(args) -> Dict[str, object]:
    """{"train", "train_eval", "val", "test"} datasets (train: augmented; others: eval)."""
    cls = DATASETS[args.dataset]
    train_tf = image_transforms(args.image_size, train=True)
    eval_tf = image_transforms(args.image_size, train=False)
    kw: Dict[str, object] = {"protocol": "classification"}
    if args.dataset in ("cub", "cars"):
        kw["bbox_crop"] = not args.no_bbox
        if args.val_fraction is not None:
            kw["val_fraction"] = args.val_fraction
    if args.dataset in ("cub", "cars", "leafsnap"):
        kw["seed"] = args.seed
    out = {"train": cls(args.data_root, "train", transform=train_tf, **kw)}
    kw["check_files"] = False  # the same tree: checked once above (val/test below)
    out["train_eval"] = cls(args.data_root, "train", transform=eval_tf, **kw)
    kw["check_files"] = True
    out["val"] = cls(args.data_root, "val", transform=eval_tf, **kw)
    out["test"] = cls(args.data_root, "test", transform=eval_tf, **kw)
    return out


def run_one(args, loss: str, device: torch.device, splits) -> Dict:
    run_dir = os.path.join(args.out, loss)
    sigma = args.sigma if args.sigma is not None else default_sigma(args.arch)
    # a checkpoint of other settings is not resumed as if it were this run
    check_resume(run_dir, run_settings(args, loss=loss, sigma=sigma), args.restart)
    seed_everything(args.seed)
    kernel = loss == "nngk"
    # The kernel loss reads FC7 without its ReLU (the papers); softmax keeps the standard one.
    model = build_embedding_net(args.arch, dim=None, dropout=args.dropout,
                                pretrained=args.pretrained, relu=not kernel).to(device)
    dim = FEATURE_DIM[args.arch]
    progress = not args.no_progress
    train = splits["train"]
    bs_eval = max(args.batch_size, 64)
    train_loader = make_loader(train, args.batch_size, True, args.workers, device,
                               drop_last=len(train) > args.batch_size)
    train_loader = nkd.shard_loader(train_loader, seed=args.seed)  # torchrun: this rank's share
    ordered = make_loader(splits["train_eval"], bs_eval, False, args.workers, device)
    val_loader = make_loader(splits["val"], bs_eval, False, args.workers, device)
    test_loader = make_loader(splits["test"], bs_eval, False, args.workers, device)
    if kernel:
        # The refresh embeds this rank's share; evaluation keeps the full ``ordered``.
        criterion, refresher = kernel_criterion(
            model, nkd.shard_loader(ordered, split_batch=False), as_tensor_labels(train), dim,
            sigma, args.k, device,
            learn_weights=not args.fixed_weights, progress=progress)
        extra = dict(refresher=refresher, weights_lr=args.weights_lr, lr=args.lr,
                     schedule=RefreshSchedule(every_epochs=args.update_interval))
    else:
        criterion = SoftmaxHead(dim, train.num_classes)
        extra = dict(lr=args.softmax_lr)

    def validate(model, crit, epoch):
        m = classification_metrics(model, crit, ordered, val_loader, k=args.k, device=device,
                                   amp=args.amp, progress=progress)
        return {"val_accuracy": m["accuracy"], "val_loss": m["loss"]}

    trainer = Trainer(model, criterion, train_loader, device=device, optimizer="sgd",
                      momentum=args.momentum, weight_decay=args.weight_decay, amp=args.amp,
                      out_dir=run_dir, seed=args.seed, progress=progress, eval_fn=validate,
                      eval_every=args.eval_every or args.epochs,
                      desc=f"{args.dataset} {args.arch} {loss}", **extra)
    t0 = time.perf_counter()
    history = trainer.fit(args.epochs, resume=not args.restart)
    check_epochs(trainer, args.epochs)
    last = history[-1]
    if last.get("val_accuracy") is not None and last.get("val_loss") is not None:
        val = {"accuracy": last["val_accuracy"], "loss": last["val_loss"]}  # the final model
    else:
        val = classification_metrics(model, criterion, ordered, val_loader, k=args.k,
                                     device=device, amp=args.amp, progress=progress)
    test = classification_metrics(model, criterion, ordered, test_loader, k=args.k,
                                  device=device, amp=args.amp, progress=progress)
    if nkd.is_main_process():
        plot_training_curves({loss: history}, os.path.join(run_dir, "training_curves.png"),
                             keys=("loss", "val_accuracy"),
                             title=f"{args.dataset} {args.arch} {loss}")
    entry = {"val_accuracy": val["accuracy"], "val_loss": val["loss"],
             "test_accuracy": test["accuracy"], "test_loss": test["loss"],
             "epochs": args.epochs, "lr": extra["lr"], "train_seconds": time.perf_counter() - t0}
    if kernel:
        entry.update(sigma=sigma, k=refresher.k, learned_weights=not args.fixed_weights)
    return entry


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    device = start_run(args.device, args.out)
    splits = load_splits(args)
    runs = {loss: run_one(args, loss, device, splits) for loss in args.loss}
    paper = PAPER.get((args.dataset, args.arch))
    results = {"dataset": args.dataset, "arch": args.arch, "pretrained": args.pretrained,
               "device": str(device), "bbox_crop": args.dataset in ("cub", "cars") and
               not args.no_bbox,
               "sizes": {s: len(splits[s]) for s in ("train", "val", "test")},
               "num_classes": splits["train"].num_classes, "runs": runs,
               "paper": None if paper is None else {"softmax": paper[0] / 100,
                                                    "nngk": paper[1] / 100}}
    if not nkd.is_main_process():  # every rank has the same results; rank 0 writes them
        return results
    write_json(os.path.join(args.out, "results.json"), results)
    rows = [[loss, percent(r["val_accuracy"]), f"{r['val_loss']:.4f}",
             percent(r["test_accuracy"]),
             "-" if paper is None else f"{paper[0 if loss == 'softmax' else 1]:.2f}"]
            for loss, r in runs.items()]
    table = markdown_table(["Loss", "Val acc", "Val loss", "Test acc", "Paper test acc"], rows,
                           title=f"{NAMES[args.dataset]}, {args.arch}: test set accuracy")
    write_table(os.path.join(args.out, "results.md"), table)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    nkd.shutdown()
