"""The small end-to-end demo: the kernel loss vs softmax on scikit-learn's 8x8 digits.

    python repro/digits.py --out results/digits          # a few minutes on 2 CPU cores
    python repro/digits.py --out /tmp/d --quick          # seconds (smoke test)

No download: ``sklearn.datasets.load_digits`` ships with scikit-learn (1,797 images, 8x8).
Two experiments with the same network (:class:`nnkloss.experiment.models.DigitsNet`, a small CNN with
dropout), optimiser and budget for both losses:

* metric learning on held-out classes: train on digits 0-4, embed digits 5-9, report
  Recall@1/2/4/8 and NMI (the papers' Tables 1-2 protocol). The softmax baseline's embedding
  is the same layer (the one its linear classifier reads);
* classification on all ten digits (a seeded, stratified 70/30 train/test split): test
  accuracy of the kernel classifier (Eq. 3 over the bank of training embeddings, learned
  weights) and of softmax.

The kernel loss runs on the real stack: CentreBank + NeighbourKernelLoss (the fused op;
Triton on a GPU) + Refresher (initial bank before the first step, then every
``--refresh-every`` epochs) + NeighbourKernelClassifier + the metrics module.

Beside the trained networks, the raw pixels (no training: 1-nearest neighbour for
classification) give the floor. Outputs in ``--out`` (its path is printed at the end):
results.json (schema below, fractions in [0, 1]), results.md (the same as a table, also
printed), embedding_nngk.png / embedding_softmax.png (test classes 5-9), recall.png,
training_curves.png, and one sub-folder per run with its log.csv/log.json and checkpoint.

    {"metric_learning": {"nngk": {"recall@1", "recall@2", "recall@4", "recall@8", "map@r",
                                  "r_precision", "nmi"},
                         "softmax": {...}, "pixels": {...}},
     "classification": {"nngk": {"accuracy"}, "softmax": {"accuracy"}, "pixels": {"accuracy"}}}

Several processes: ``torchrun --nproc-per-node 2 repro/digits.py --out OUT --quick`` (gloo on
the CPU; with ``--device cuda``, NCCL and one GPU per process). ``--batch-size`` stays the
global batch (a multiple of the process count); only rank 0 writes files.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from nnkloss import distributed as nkd
from nnkloss.experiment.datasets import IndexedTensorDataset, stratified_split
from nnkloss.experiment.evaluate import (extract_embeddings, kernel_accuracy,
                                         nearest_neighbour_accuracy, retrieval_metrics,
                                         softmax_accuracy)
from nnkloss.evaluation.metrics import recall_at_k
from nnkloss.experiment.setup import HelpFormatter, kernel_criterion, start_run
from nnkloss.experiment.models import DigitsNet, SoftmaxHead
from nnkloss.experiment.plots import plot_embedding, plot_recall_curve, plot_training_curves
from nnkloss.bank.refresh import RefreshSchedule
from nnkloss.experiment.reporting import markdown_table, percent, write_json, write_table
from nnkloss.experiment.seeds import seed_arg
from nnkloss.experiment.train import Trainer, seed_everything

METRIC_KEYS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2 epochs, PCA instead of t-SNE for the picture")
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (default 30; 2 "
                   "with --quick)")
    p.add_argument("--dim", type=int, default=64, help="embedding size")
    p.add_argument("--k", type=int, default=100, help="neighbours per bank row (training)")
    p.add_argument("--classify-k", type=int, default=20,
                   help="neighbours of the kernel classifier at test time")
    p.add_argument("--sigma", type=float, default=0.1, help="kernel width")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (both losses)")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--weights-lr", type=float, default=1e-2,
                   help="learning rate of the per-centre weights (classification)")
    p.add_argument("--refresh-every", type=int, default=1,
                   help="update interval in epochs (bank + neighbour lists)")
    p.add_argument("--refresh-steps", type=int, default=None,
                   help="also refresh every this many optimiser steps")
    p.add_argument("--learn-sigma", action="store_true", help="learn sigma (its lr: --lr)")
    p.add_argument("--dropout", type=float, default=0.2, help="dropout on the hidden layer")
    p.add_argument("--embed-dropout", type=float, default=0.0,
                   help="dropout on the embedding itself (training embeddings only)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    p.add_argument("--shift", type=int, default=1,
                   help="training augmentation: random translation by up to this many pixels")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads throughout (default: torch's setting)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 30
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def load_digits_tensors() -> Tuple[torch.Tensor, torch.Tensor]:
    """x (1797, 1, 8, 8) float32 in [0, 1], y (1797,) int64 in 0..9."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    return x, torch.from_numpy(d.target.astype(np.int64))


class RandomShift:
    """Translate a (1, H, W) image by up to ``max_shift`` pixels in x and y (zero fill)."""

    def __init__(self, max_shift: int):
        self.max_shift = int(max_shift)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        m = self.max_shift
        h, w = img.shape[-2:]
        padded = torch.nn.functional.pad(img, (m, m, m, m))
        dy, dx = torch.randint(0, 2 * m + 1, (2,)).tolist()
        return padded[..., dy:dy + h, dx:dx + w]


def train_run(name: str, loss: str, x: torch.Tensor, y: torch.Tensor, num_classes: int,
              args, learn_weights: bool, eval_fn=None):
    """Train DigitsNet on (x, y) with the kernel loss ("nngk") or softmax; returns
    (model, criterion, trainer)."""
    seed_everything(args.seed)
    model = DigitsNet(dim=args.dim, dropout=args.dropout, embed_dropout=args.embed_dropout)
    ds = IndexedTensorDataset(x, y)
    augmented = IndexedTensorDataset(x, y, transform=RandomShift(args.shift) if args.shift else None)
    train_loader = DataLoader(augmented, batch_size=args.batch_size, shuffle=True)
    train_loader = nkd.shard_loader(train_loader, seed=args.seed)  # torchrun: this rank's share
    kw = dict(device=args.device, optimizer=args.optimizer, lr=args.lr, threads=args.threads,
              weight_decay=args.weight_decay,
              out_dir=os.path.join(args.out, name), seed=args.seed,
              progress=not args.no_progress, eval_fn=eval_fn, desc=name)
    if loss == "nngk":
        # The bank is refreshed from an unshuffled, unaugmented pass in eval mode (no dropout).
        ordered = nkd.shard_loader(DataLoader(ds, batch_size=512, shuffle=False),
                                   split_batch=False)
        criterion, refresher = kernel_criterion(
            model, ordered, y, args.dim, args.sigma, args.k, args.device,
            learn_weights=learn_weights, learn_sigma=args.learn_sigma, ensure_positive=True,
            progress=False)
        trainer = Trainer(model, criterion, train_loader, refresher=refresher,
                          schedule=RefreshSchedule(every_epochs=args.refresh_every,
                                                   every_steps=args.refresh_steps),
                          weights_lr=args.weights_lr, **kw)
    else:
        trainer = Trainer(model, SoftmaxHead(args.dim, num_classes), train_loader, **kw)
    # A fresh run each time (the demo is short; resume is for the long scripts).
    trainer.fit(args.epochs, resume=False)
    return model, trainer.criterion, trainer


def kernel_classifier_accuracy(model, criterion, x_train, y_train, x_test, y_test, args
                               ) -> float:
    """Eq. 3 (NeighbourKernelClassifier) over a bank of the current model's training
    embeddings with the learned per-centre weights. A separate bank: evaluating must not
    change the one the loss trains with."""
    emb_train, lab_train = _embed(model, x_train, y_train, args)
    emb_test, lab_test = _embed(model, x_test, y_test, args)
    return kernel_accuracy(emb_train, lab_train, emb_test, lab_test, k=args.classify_k,
                           sigma=criterion.kernel_sigma(),
                           weights=criterion.bank.weights.detach().cpu())


def _embed(model, x, y, args):
    return extract_embeddings(model, DataLoader(IndexedTensorDataset(x, y), batch_size=512),
                              device=args.device)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    saved_threads = torch.get_num_threads()
    try:
        return _main(parse_args(argv))
    finally:
        torch.set_num_threads(saved_threads)  # the caller's setting, whatever the runs chose


def _main(args) -> Dict:
    # torchrun: one process per device, gloo for CPU runs; "auto" becomes the device it names
    args.device = str(start_run(args.device, args.out))
    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    x, y = load_digits_tensors()

    # ---------------------------------------------------------------- metric learning
    seen = y < 5
    x_tr, y_tr = x[seen], y[seen]
    x_te, y_te = x[~seen], y[~seen] - 5

    def metric_eval(model, criterion, epoch):
        emb, lab = _embed(model, x_te, y_te, args)
        return {"test_recall@1": recall_at_k(emb, lab, (1,))[1]}

    metric: Dict[str, Dict[str, float]] = {}
    test_emb: Dict[str, torch.Tensor] = {}
    histories = {}
    for loss in ("nngk", "softmax"):
        model, crit, tr = train_run(f"metric_{loss}", loss, x_tr, y_tr, 5, args,
                                    learn_weights=False, eval_fn=metric_eval)
        emb, lab = _embed(model, x_te, y_te, args)
        metric[loss] = retrieval_metrics(emb, lab, seed=args.seed)
        test_emb[loss] = emb
        histories[f"metric {loss}"] = tr.history
    # The floor a trained network must beat: the raw pixels, no training.
    metric["pixels"] = retrieval_metrics(x_te.flatten(1), y_te, seed=args.seed)

    # ---------------------------------------------------------------- classification
    tr_pos, te_pos = stratified_split(y.numpy(), (0.7, 0.3), seed=args.seed)
    x_ctr, y_ctr, x_cte, y_cte = x[tr_pos], y[tr_pos], x[te_pos], y[te_pos]
    classification: Dict[str, Dict[str, float]] = {}

    def cls_eval_nngk(model, criterion, epoch):
        return {"test_accuracy": kernel_classifier_accuracy(model, criterion, x_ctr, y_ctr,
                                                            x_cte, y_cte, args)}

    def cls_eval_softmax(model, criterion, epoch):
        emb, _ = _embed(model, x_cte, y_cte, args)
        return {"test_accuracy": softmax_accuracy(criterion, emb, y_cte)}

    model, crit, tr = train_run("classification_nngk", "nngk", x_ctr, y_ctr, 10, args,
                                learn_weights=True, eval_fn=cls_eval_nngk)
    classification["nngk"] = {"accuracy": kernel_classifier_accuracy(
        model, crit, x_ctr, y_ctr, x_cte, y_cte, args)}
    histories["classification nngk"] = tr.history
    model, crit, tr = train_run("classification_softmax", "softmax", x_ctr, y_ctr, 10, args,
                                learn_weights=False, eval_fn=cls_eval_softmax)
    emb, _ = _embed(model, x_cte, y_cte, args)
    classification["softmax"] = {"accuracy": softmax_accuracy(crit, emb, y_cte)}
    histories["classification softmax"] = tr.history
    classification["pixels"] = {"accuracy": nearest_neighbour_accuracy(
        x_ctr.flatten(1), y_ctr, x_cte.flatten(1), y_cte)}

    results = {"metric_learning": metric, "classification": classification}
    if not nkd.is_main_process():  # every rank has the same results; rank 0 writes them
        return results
    write_json(os.path.join(args.out, "results.json"), results)

    # ---------------------------------------------------------------- report
    table = markdown_table(
        ["Loss", "R@1", "R@2", "R@4", "R@8", "MAP@R", "NMI"],
        [[loss] + [percent(metric[loss][k]) for k in METRIC_KEYS] for loss in metric],
        title=f"Metric learning on held-out digits 5-9 (trained on 0-4), dim {args.dim}; "
              f"pixels: the raw 64 pixels, untrained (the floor)")
    table += "\n" + markdown_table(
        ["Loss", "Test accuracy"],
        [[loss, percent(classification[loss]["accuracy"])] for loss in classification],
        title="Classification, all ten digits (70/30 split); pixels: 1-nearest neighbour")
    elapsed = time.perf_counter() - t_start
    threads = f"{torch.get_num_threads()} threads"
    table += (f"\n{args.epochs} epochs per run, total time {elapsed:.0f} s on {args.device}, "
              f"{threads}.\n")
    write_table(os.path.join(args.out, "results.md"), table)

    method = "pca" if args.quick else "tsne"
    for loss, emb in test_emb.items():
        plot_embedding(emb, y_te + 5, os.path.join(args.out, f"embedding_{loss}.png"),
                       method=method, seed=args.seed,
                       title=f"{loss}: held-out digits 5-9 ({method.upper()})")
    plot_recall_curve({loss: {k: metric[loss][f"recall@{k}"] for k in (1, 2, 4, 8)}
                       for loss in metric}, os.path.join(args.out, "recall.png"),
                      title="Recall@K on held-out digits 5-9")
    plot_training_curves(histories, os.path.join(args.out, "training_curves.png"),
                         keys=("loss", "test_recall@1", "test_accuracy"),
                         title="digits: training loss and test metrics per epoch")
    print(f"Files written to {os.path.abspath(args.out)}: results.json, results.md, "
          f"recall.png, training_curves.png, embedding_*.png, and a folder per run.")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    nkd.shutdown()
