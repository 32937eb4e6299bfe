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


def test_the_library_is_ready_before_the_timed_region(monkeypatch):
    """A worker builds / loads nnkloss's compiled library before its clock starts (a build
    after a source change takes ~20 s and was once timed as evaluation); PML's workers don't."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_eval
    finally:
        sys.path.pop(0)
    from nnkloss import cpu
    events = []
    monkeypatch.setattr(cpu, "available", lambda: events.append("build") or True)
    monkeypatch.setattr(bench_eval, "run_nnkloss",
                        lambda *a, **k: events.append("timed") or {})
    monkeypatch.setattr(bench_eval, "run_pml", lambda *a, **k: events.append("pml") or {})
    monkeypatch.setattr(bench_eval, "worker_reply", lambda res: None)
    for provider in ("nnkloss", "nnkloss-faiss", "pml"):
        bench_eval.worker({"provider": provider, "N": 60, "D": 4, "classes": 3})
    assert events == ["build", "timed", "build", "timed", "pml"]
    # a search on the GPU does not use the library: no build (device time on a fresh machine)
    events.clear()
    bench_eval.prepare("nnkloss", "cuda:0")
    bench_eval.prepare("nnkloss", "cpu")
    assert events == ["build"]


def test_the_torch_mm_provider_switches_the_gemm_only(monkeypatch):
    """nnkloss-torch-mm: the default search with torch.mm tiles (the A/B of the two GEMMs);
    the other nnkloss providers keep the library's GEMM."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_eval
    finally:
        sys.path.pop(0)
    from nnkloss.bank.search import torch_search
    from nnkloss.evaluation import metrics
    seen = []
    monkeypatch.setattr(torch_search, "COMPILED_GEMM", True)
    monkeypatch.setattr(metrics, "evaluate", lambda *a, search_backend, **k: seen.append(
        (search_backend, torch_search.COMPILED_GEMM)) or {})
    monkeypatch.setattr(bench_eval, "worker_reply", lambda res: None)
    for provider in ("nnkloss", "nnkloss-torch-mm", "nnkloss-faiss"):
        bench_eval.worker({"provider": provider, "N": 60, "D": 4, "classes": 3})
    assert seen == [("auto", True), ("auto", False), ("faiss", True)]


@pytest.mark.cuda
def test_bench_eval_searches_on_the_gpu_with_the_cpus_values(tmp_path):
    """--device cuda: the nnkloss provider's search runs on the GPU (its peak allocation is
    reported) and gives the CPU's values (the same embeddings, the same exact search up to
    the last bits of the distances). Skipped without a GPU (conftest: the cuda mark)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    rows = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        proc = subprocess.run([sys.executable, "benchmarks/bench_eval.py", "--N", "3000",
                               "--classes", "10", "--providers", "nnkloss", "--device",
                               device, "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (path,) = [p for p in out.iterdir() if p.suffix == ".csv"]
        (rows[device],) = list(csv.DictReader(open(path)))
    assert not rows["cuda"]["error"]
    assert rows["cpu"]["gpu_peak_mb"] == "" and float(rows["cuda"]["gpu_peak_mb"]) > 0
    assert rows["cuda"]["device"] != rows["cpu"]["device"]
    for key in ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision"):
        assert float(rows["cuda"][key]) == pytest.approx(float(rows["cpu"][key]), abs=1e-3), key


def test_bench_eval_runs_at_each_thread_count_and_splits_the_search(tmp_path):
    """--threads 1 2: a row per count, run at that count (the worker reports the count it
    read); --phases: the CPU search's GEMM, selection and finish each took time, within the
    call's seconds. A count below 1 is refused by name."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = [sys.executable, "benchmarks/bench_eval.py", "--N", "600", "--classes", "6",
            "--providers", "nnkloss", "--out", str(tmp_path)]
    proc = subprocess.run(args + ["--threads", "1", "2", "--phases"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".csv"]
    rows = list(csv.DictReader(open(path)))
    assert [r["threads"] for r in rows] == ["1", "2"]
    for row in rows:
        assert not row["error"], row["error"]
        parts = [float(row[key]) for key in ("gemm_s", "select_s", "finish_s")]
        assert all(p > 0 for p in parts), parts
        assert sum(parts) < float(row["seconds"])
    assert rows[0]["map@r"] == rows[1]["map@r"]  # the same search at either count
    bad = subprocess.run(args + ["--threads", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--threads" in bad.stderr
