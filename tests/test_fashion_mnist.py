"""The kernel loss on real data: 1 epoch on a few thousand Fashion-MNIST images.

Needs the official files (``apt-get install dataset-fashion-mnist``, which ``.ci/run`` does
where apt-get exists); ``FASHION_MNIST_ROOT`` points elsewhere. Skipped, saying so, without them.
"""
import importlib.util
import json
import os

import pytest
import torch

ROOT = os.environ.get("FASHION_MNIST_ROOT", "/usr/share/datasets/fashion-mnist")
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")


def _have_files() -> bool:
    from nnkloss.experiment.datasets import find_idx_file
    try:
        for f in FILES:
            find_idx_file(ROOT, f)
    except FileNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _have_files(), reason=f"Fashion-MNIST files not found in {ROOT} (apt-get install "
                              "dataset-fashion-mnist, or set FASHION_MNIST_ROOT)")


def test_real_files_read_and_checked():
    from nnkloss.experiment.datasets import FashionMNIST
    te = FashionMNIST(ROOT, "test")
    assert len(te) == 10_000 and te.inputs.shape == (10_000, 1, 28, 28)
    assert torch.bincount(te.labels).tolist() == [1000] * 10


def test_one_epoch_on_real_images_beats_chance_by_far(tmp_path):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "repro",
                        "fashion_mnist.py")
    spec = importlib.util.spec_from_file_location("repro_fashion_mnist", path)
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    # 3,000 training images of classes 0-4, 1,000 test images of the unseen classes 5-9.
    res = fm.main(["--data-root", ROOT, "--out", str(tmp_path), "--methods", "nngk",
                   "--seeds", "0", "--epochs", "1", "--train-per-class", "600",
                   "--eval-per-class", "200", "--no-progress", "--threads", "2",
                   "--nmi-inits", "2"])
    run = res["runs"]["nngk/s0"]
    assert run["config"]["train_images"] == 3000 and run["config"]["eval_images"] == 1000
    m = run["metrics"]
    # chance: the nearest of 999 others is same-class with probability 199/999 ~ 0.2
    assert m["recall@1"] > 0.7, m
    assert m["map@r"] > 0.25, m
    assert json.load(open(tmp_path / "results.json"))["runs"]["nngk/s0"]["metrics"] == m
