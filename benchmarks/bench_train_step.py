"""One real training step with the loss in it, against the losses a user would use instead.

    python benchmarks/bench_train_step.py --device cuda     # ResNet-50, 224 px, batch 128,
                                                            # bank N 1M, K 100, D 512
    python benchmarks/bench_train_step.py --device cpu --batch 2 --image 32 --N 200 --K 8 \
        --D 16 --warmup 1 --steps 1                         # smoke run

A step: a batch of images through torchvision's ResNet-50 (random weights, its last layer D
wide, training mode), the loss of its embeddings, the backward, an SGD step. Providers:

- ``none``: the backbone alone (the embeddings' mean square as the loss), the step the others
  are held against;
- ``fused``: ``NeighbourKernelLoss`` over a ``CentreBank`` of N centres holding K-entry lists
  (value checks off, as after a training loop's first step);
- ``compile`` and ``eager``: the loss as a user would write it (``bench_loss.eager_loss``),
  under ``torch.compile`` and as is, over the same lists;
- ``pml``: pytorch-metric-learning's ``ContrastiveLoss`` over the batch's pairs (no bank);
  where the package is missing, its row says so.

Writes ``<out>/train_step_<device>.csv`` (``common.TABLE_COLUMNS``: pass "both") and prints
the table. ``wall_ms``: ``--steps`` back-to-back steps after ``--warmup`` (one
synchronisation at the end) over their count; ``peak_mb``: the timed steps' peak above what
was allocated before them (model, optimiser state, bank); the note: the loss's share of the
step, 1 - none's step time / the provider's (measured in the same process).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_loss import eager_loss  # noqa: E402
from common import (PeakMemory, command_line, device_name, git_commit,  # noqa: E402
                    markdown, parse_device, table_csv, table_row)

import torch  # noqa: E402

import nnkloss  # noqa: E402

PROVIDERS = ["none", "fused", "compile", "eager", "pml"]
CLASSES = 100


def make_losses(args, device):
    """Each provider's loss of (embeddings, labels, bank rows of the batch), and the batch's
    labels and rows: a bank of ``args.N`` random centres, CLASSES labels, random K-entry lists
    with each row's own centre first (its class among its neighbours)."""
    g = torch.Generator(device=device).manual_seed(0)
    centres = torch.randn(args.N, args.D, generator=g, device=device)
    centre_labels = torch.randint(0, CLASSES, (args.N,), generator=g, dtype=torch.int32,
                                  device=device)
    lists = torch.randint(0, args.N, (args.N, args.K), generator=g, dtype=torch.int32,
                          device=device)
    lists[:, 0] = torch.arange(args.N, dtype=torch.int32, device=device)
    idx = torch.randperm(args.N, generator=g, device=device)[:args.batch]
    labels = centre_labels[idx]
    bank = nnkloss.CentreBank(centres, centre_labels, neighbours=lists)
    sigma = float(args.D) ** 0.5 * 0.5
    module = nnkloss.NeighbourKernelLoss(bank, sigma=sigma, exclude_self=False)
    weights = torch.ones(args.N, device=device)
    sigma_t = torch.tensor(sigma, device=device)
    compiled = torch.compile(eager_loss, dynamic=False)

    def user_loss(fn):
        return lambda emb, labels, idx: fn(emb, labels, centres, centre_labels, lists[idx],
                                           weights, sigma_t)

    losses = {"none": lambda emb, labels, idx: emb.square().mean(), "fused": module,
              "compile": user_loss(compiled), "eager": user_loss(eager_loss)}
    try:
        from pytorch_metric_learning import losses as pml
        contrastive = pml.ContrastiveLoss()
        losses["pml"] = lambda emb, labels, idx: contrastive(emb, labels)
    except ImportError:
        pass  # the row says so
    return losses, labels, idx


def time_steps(step, device, warmup, steps):
    """(ms per step over ``steps`` back-to-back steps after ``warmup``, their peak MiB above
    what was allocated before them)."""
    for _ in range(warmup):
        step()
    meter = PeakMemory(device).start()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t) * 1e3 / steps
    return ms, meter.peak_mb()

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arch", default="resnet50", help="a torchvision model (smoke runs: a "
                    "smaller one)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, default=224, help="pixels a side")
    ap.add_argument("--N", type=int, default=1_000_000, help="bank rows")
    ap.add_argument("--K", type=int, default=100, help="list entries a row")
    ap.add_argument("--D", type=int, default=512, help="embedding width")
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    device = parse_device(ap, args.device)
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=args.D).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, args.image, args.image, device=device)
    losses, labels, idx = make_losses(args, device)
    name, commit = device_name(device), git_commit()
    command = command_line(__file__, argv)
    shape = f"{args.arch} B={args.batch} px={args.image} N={args.N} K={args.K} D={args.D}"
    print(f"device: {name} | commit {commit} | {shape} | threads {torch.get_num_threads()}")
    rows, step_ms = [], {}
    with table_csv(args.out, "train_step", device) as out:
        for prov in args.providers:
            row = dict(operation="train_step", provider=prov, pass_="both", shape=shape,
                       dtype="fp32")
            if prov not in losses:
                row = table_row(**row, note="skipped: pytorch-metric-learning is not installed")
            else:
                fn = losses[prov]

                def step():
                    opt.zero_grad(set_to_none=True)
                    fn(model(images), labels, idx).backward()
                    opt.step()
                with nnkloss.value_checks(False):
                    ms, peak = time_steps(step, device, args.warmup, args.steps)
                step_ms[prov] = ms
                share = (f"loss share {100 * (1 - step_ms['none'] / ms):.1f}%"
                         if "none" in step_ms and prov != "none" else "")
                row = table_row(**row, wall_ms=ms, peak_mb=peak, note=share)
            row.update(threads=torch.get_num_threads(), device=name, commit=commit, command=command)
            out.write(row, echo=False)
            rows.append(row)
            print(f"    {prov}: step {row['wall_ms'] or '-'} ms, peak {row['peak_mb'] or '-'} MB"
                  f" {row['note']}", flush=True)
    print(markdown(rows))
    return out.path


if __name__ == "__main__":
    main()
