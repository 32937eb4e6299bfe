"""Tables 1-2 of Meyer et al. (ICIP 2018): metric learning on Cars196 and CUB-200-2011.

    python repro/metric_learning.py --dataset cars --data-root /data/cars196 \\
        --pretrained /weights/googlenet-1378be20.pth --dim 64 128 256 512 1024 --out results/ml_cars

Protocol (Song et al. 2016, as in the paper): train on the first half of the classes
(Cars 1-98, CUB 1-100), evaluate Recall@1/2/4/8 and NMI on the second half (and MAP@R and
R-precision, which the paper did not report, from the same search); no bounding boxes.
Model: GoogLeNet (torchvision, ``weights=None``; ImageNet weights only from ``--pretrained``,
a local torchvision-format state dict, never downloaded) with a final fully connected layer of
``--dim`` outputs as the embedding. The paper's hyper-parameters are the defaults: K = 100
neighbours, update interval 10 epochs, batch 20, SGD lr 1e-5 (momentum 0.9, not stated in the
paper), weight decay 2e-4, 50 epochs on Cars and 30 on CUB, images resized to 256x256 with
random 224 crops and flips. The paper gives sigma only as "10 to 30 depending on the
dimension"; the default here grows with the dimension (see ``default_sigma``); pass --sigma to
choose.

One run per ``--dim``; each writes its log and checkpoint under ``OUT/dim<D>/`` (rerunning
resumes from the checkpoint unless --restart). ``OUT/results.json`` holds, per run, the metrics
(fractions in [0, 1]) and settings; ``OUT/results.md`` the table in the paper's format with the
paper's own rows for comparison.
Several GPUs: ``torchrun --nproc-per-node G repro/metric_learning.py ...`` (one process per GPU;
``--batch-size`` stays the global batch and must be a multiple of G; only rank 0 writes files;
see :mod:`nnkloss.distributed`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from nnkloss.experiment.datasets import CUB200, Cars196, as_tensor_labels
from nnkloss.experiment.evaluate import RECALL_KS, extract_embeddings, retrieval_metrics
from nnkloss import distributed as nkd
from nnkloss.experiment.setup import (HelpFormatter, check_epochs, check_resume, image_transforms,
                                      kernel_criterion, make_loader, run_settings, start_run)
from nnkloss.experiment.models import MIN_IMAGE_SIZE, build_embedding_net
from nnkloss.experiment.plots import plot_embedding, plot_recall_curve, plot_training_curves
from nnkloss.bank.refresh import RefreshSchedule
from nnkloss.experiment.reporting import markdown_table, percent, write_json, write_table
from nnkloss.experiment.seeds import seed_arg
from nnkloss.experiment.train import Trainer, seed_everything

DATASETS = {"cub": CUB200, "cars": Cars196}
DEFAULT_EPOCHS = {"cars": 50, "cub": 30}
NAMES = {"cars": "Cars196", "cub": "Birds200 (CUB-200-2011)"}

# The paper's "Ours" rows (Tables 1 and 2): dim -> (R@1, R@2, R@4, R@8, NMI), in %.
PAPER = {
    "cars": {64: (71.05, 80.74, 88.06, 92.79, 62.15), 128: (73.52, 83.37, 89.80, 93.76, 63.35),
             256: (77.35, 85.49, 91.10, 94.81, 63.76), 512: (78.39, 86.91, 92.06, 95.52, 64.68),
             1024: (79.65, 87.33, 92.36, 95.65, 65.30)},
    "cub": {64: (51.15, 64.64, 75.57, 84.72, 61.26), 128: (52.08, 64.69, 76.05, 84.86, 61.72),
            256: (54.74, 67.18, 77.53, 86.09, 62.18), 512: (55.91, 68.26, 78.63, 86.38, 63.50),
            1024: (57.22, 68.75, 79.12, 87.14, 63.95)},
}
KEYS = [f"recall@{k}" for k in RECALL_KS] + ["nmi"]     # the paper's columns
RUN_KEYS = KEYS + ["map@r", "r_precision"]              # what a run reports


def default_sigma(dim: int) -> float:
    """Our choice inside the paper's 10-30: 10 at 64 dimensions, +5 per doubling, 30 at 1024.

    Squared distances between embeddings grow about linearly with the dimension, so the width
    has to grow with it; the paper does not give its per-dimension values."""
    return float(min(30.0, max(10.0, 10.0 + 5.0 * math.log2(max(dim, 1) / 64.0))))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--dataset", required=True, choices=sorted(DATASETS))
    p.add_argument("--data-root", required=True,
                   help="CUB: the CUB_200_2011 folder (or its parent); Cars: the folder with "
                        "car_ims/ and cars_annos.mat")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dim", type=int, nargs="+", default=[64],
                   help="embedding size(s); one run each")
    p.add_argument("--sigma", type=float, default=None,
                   help="kernel width (default: per dimension, 10 at 64-d ... 30 at 1024-d)")
    p.add_argument("--epochs", type=int, default=None, help="default: 50 Cars, 30 CUB")
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--image-size", type=int, default=224,
                   help="crop size (images are first resized to size*256/224)")
    p.add_argument("--k", type=int, default=100, help="neighbours per bank row")
    p.add_argument("--update-interval", type=int, default=10,
                   help="epochs between bank refreshes")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=2e-4)
    p.add_argument("--pretrained", default=None,
                   help="local GoogLeNet state dict (torchvision format), e.g. ImageNet weights")
    p.add_argument("--device", default="auto", help="cuda, cuda:1, cpu, or auto")
    p.add_argument("--amp", action="store_true", help="mixed precision (CUDA only)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="DataLoader worker processes")
    p.add_argument("--ensure-positive", action="store_true",
                   help="give bank rows without a same-class neighbour their nearest one")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate the test classes every N epochs (0: at the end only)")
    p.add_argument("--embedding-plot", default="tsne", choices=("tsne", "pca", "none"))
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--restart", action="store_true",
                   help="train afresh: remove the runs' old checkpoints first")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = DEFAULT_EPOCHS[args.dataset]
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.image_size < MIN_IMAGE_SIZE["googlenet"]:
        p.error(f"--image-size must be >= {MIN_IMAGE_SIZE['googlenet']} for GoogLeNet")
    return args


def run_one(args, dim: int, device: torch.device, train_ds, train_eval_ds, test_ds) -> Dict:
    """Train and evaluate one embedding size; returns its results entry."""
    sigma = args.sigma if args.sigma is not None else default_sigma(dim)
    run_dir = os.path.join(args.out, f"dim{dim}")
    # a checkpoint of other settings is not resumed as if it were this run
    check_resume(run_dir, run_settings(args, dim=dim, sigma=sigma), args.restart)
    seed_everything(args.seed)
    model = build_embedding_net("googlenet", dim=dim, dropout=0.0, pretrained=args.pretrained)
    progress = not args.no_progress
    train_loader = make_loader(train_ds, args.batch_size, True, args.workers, device,
                               drop_last=len(train_ds) > args.batch_size)
    train_loader = nkd.shard_loader(train_loader, seed=args.seed)  # torchrun: this rank's share
    ordered = make_loader(train_eval_ds, max(args.batch_size, 64), False, args.workers, device)
    test_loader = make_loader(test_ds, max(args.batch_size, 64), False, args.workers, device)
    model.to(device)
    criterion, refresher = kernel_criterion(
        model, nkd.shard_loader(ordered, split_batch=False), as_tensor_labels(train_ds), dim,
        sigma, args.k, device,
        ensure_positive=args.ensure_positive, progress=progress)

    latest = {}  # the last test embeddings, for the picture

    def evaluate(model, crit, epoch):
        emb, labels = extract_embeddings(model, test_loader, device, args.amp, progress,
                                         desc="embed test")
        latest["emb"], latest["labels"] = emb, labels
        return {f"test_{k}": v for k, v in retrieval_metrics(emb, labels, seed=args.seed).items()}

    trainer = Trainer(model, criterion, train_loader, device=device, optimizer="sgd",
                      lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                      refresher=refresher,
                      schedule=RefreshSchedule(every_epochs=args.update_interval),
                      amp=args.amp, out_dir=run_dir, seed=args.seed, progress=progress,
                      eval_fn=evaluate, eval_every=args.eval_every or args.epochs,
                      desc=f"{args.dataset} dim {dim}")
    t0 = time.perf_counter()
    history = trainer.fit(args.epochs, resume=not args.restart)
    check_epochs(trainer, args.epochs)
    last = history[-1]
    if "test_nmi" in last and latest:
        metrics = {k: last[f"test_{k}"] for k in RUN_KEYS}
    else:  # the run was already complete: evaluate the restored model
        metrics = {k[len("test_"):]: v for k, v in evaluate(model, criterion, args.epochs).items()}
    emb, labels = latest["emb"], latest["labels"]
    if args.embedding_plot != "none" and nkd.is_main_process():
        plot_embedding(emb, labels, os.path.join(run_dir, "embedding.png"),
                       method=args.embedding_plot, seed=args.seed,
                       title=f"{NAMES[args.dataset]} test classes, {dim}-d")
    if nkd.is_main_process():
        plot_training_curves({f"dim {dim}": history}, os.path.join(run_dir, "training_curves.png"),
                             keys=("loss", "test_recall@1"), title=f"{args.dataset}, {dim}-d")
    return {"dim": dim, **metrics, "sigma": sigma, "k": refresher.k, "epochs": args.epochs,
            "train_images": len(train_ds), "test_images": len(test_ds),
            "train_seconds": time.perf_counter() - t0}


def paper_table(dataset: str, runs: List[Dict]) -> str:
    rows = [["Ours (this run)", r["dim"]] + [percent(r[k]) for k in KEYS + ["map@r"]]
            for r in runs]
    rows += [["Ours (paper)", d] + [f"{v:.2f}" for v in vals] + ["-"]  # no MAP@R in the paper
             for d, vals in PAPER[dataset].items()]
    return markdown_table(["Method", "Dims", "R@1", "R@2", "R@4", "R@8", "NMI", "MAP@R"], rows,
                          title=f"Embedding results on {NAMES[dataset]} (test classes unseen "
                                f"in training)")


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    device = start_run(args.device, args.out)
    cls = DATASETS[args.dataset]
    train_tf = image_transforms(args.image_size, train=True)
    eval_tf = image_transforms(args.image_size, train=False)
    # Bounding boxes are not used for metric learning (the paper).
    train_ds = cls(args.data_root, "train", protocol="metric", transform=train_tf)
    train_eval_ds = cls(args.data_root, "train", protocol="metric", transform=eval_tf,
                        check_files=False)
    test_ds = cls(args.data_root, "test", protocol="metric", transform=eval_tf,
                  check_files=False)
    runs = [run_one(args, dim, device, train_ds, train_eval_ds, test_ds) for dim in args.dim]
    results = {"dataset": args.dataset, "protocol": "metric learning, unseen test classes",
               "model": "googlenet", "pretrained": args.pretrained, "device": str(device),
               "runs": runs, "paper": {str(d): dict(zip(KEYS, (v / 100 for v in vals)))
                                       for d, vals in PAPER[args.dataset].items()}}
    if not nkd.is_main_process():  # every rank has the same results; rank 0 writes them
        return results
    write_json(os.path.join(args.out, "results.json"), results)
    table = paper_table(args.dataset, runs)
    write_table(os.path.join(args.out, "results.md"), table)
    # Ks the evaluation set was too small for are None: drawn without them.
    plot_recall_curve({f"{r['dim']}-d": {k: r[f"recall@{k}"] for k in RECALL_KS
                                         if r[f"recall@{k}"] is not None} for r in runs},
                      os.path.join(args.out, "recall.png"),
                      title=f"Recall@K, {NAMES[args.dataset]} test classes")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    nkd.shutdown()
