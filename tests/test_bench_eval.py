"""benchmarks/bench_eval.py: each provider runs in a fresh process and agrees with PML."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_eval_runs_every_provider_and_matches_pml(tmp_path):
    pytest.importorskip("pytorch_metric_learning")
    pytest.importorskip("faiss")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/bench_eval.py", "--N", "600",
                           "--classes", "6", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".csv"]
    rows = {r["provider"]: r for r in csv.DictReader(open(path))}
    assert set(rows) == {"nnkloss", "nnkloss-faiss", "pml"}
    for name, row in rows.items():
        assert not row.get("error"), (name, row.get("error"))
        assert float(row["seconds"]) > 0
    for key in ("recall@1", "recall@8", "map@r", "r_precision"):
        assert float(rows["nnkloss-faiss"][key]) == float(rows["pml"][key]), key
        assert float(rows["nnkloss"][key]) == pytest.approx(float(rows["pml"][key]), abs=1e-6)
    assert rows["nnkloss-faiss"]["equal_to_pml"] == "True"
