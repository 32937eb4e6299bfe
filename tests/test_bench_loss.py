"""The loss benchmark's eager provider is right, and a CPU smoke run writes the CSV and plot."""
import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_loss  # noqa: E402

import nnkloss  # noqa: E402


def test_eager_provider_matches_fused_op():
    inputs = bench_loss.make_inputs(6, 5, 7, 50, torch.float32, torch.device("cpu"))
    emb, labels, centres, cl, nb, w, sigma = inputs
    nb[0, 1:] = -1
    a = bench_loss.eager_loss(emb, labels, centres, cl, nb, w, sigma)
    b = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma, backend="torch")
    torch.testing.assert_close(a, b)


def test_cpu_smoke_run_writes_csv_and_plot(tmp_path):
    try:
        path = bench_loss.main(["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N",
                                "40", "--dtype", "fp32", "bf16", "--providers", "fused", "eager",
                                "--out", str(tmp_path)])
    finally:
        nnkloss.set_value_checks(True)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == bench_loss.COLUMNS
    assert len(rows) == 2 * 2 * 2  # dtypes x modes x providers
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    assert os.path.getsize(path.replace(".csv", ".png")) > 1000


@pytest.mark.interpreter
def test_tuner_smoke_run_checks_every_config(tmp_path):
    import tune_loss
    path, summary = tune_loss.main(["--device", "cpu", "--B", "2", "--K", "5", "--D", "8",
                                    "--N", "30", "--dtype", "fp32", "--max-configs", "4",
                                    "--out", str(tmp_path)])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == tune_loss.COLUMNS
    assert len(rows) == 4 and all(r["ok"] == "1" for r in rows)
    assert len(summary) == 1 and summary[0][5] > 0
