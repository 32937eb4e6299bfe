"""benchmarks/bench_classifier.py: its providers compute the classifier's distances, and a CPU
smoke run writes one row per provider, each measured in a fresh process."""
import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_classifier  # noqa: E402
from cases import rel_sqdist_fp64  # noqa: E402


def test_providers_compute_the_relative_distances():
    from nnkloss import cpu
    args = bench_classifier.setup(30, 7, 12, 90, torch.device("cpu"))
    want = rel_sqdist_fp64(*args)
    fns = {"torch": bench_classifier.provider_fn("torch"), "user": bench_classifier.user_form}
    if cpu.available():
        fns["fused"] = bench_classifier.provider_fn("fused")
    for name, fn in fns.items():
        got = fn(*args)
        assert got.shape == (30, 7) and got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=name)
    with pytest.raises(ValueError, match="provider"):
        bench_classifier.provider_fn("eager")


def test_cpu_smoke_run_writes_a_row_per_provider(tmp_path):
    from nnkloss import cpu
    if not cpu.available():
        pytest.skip("no C++ compiler: no fused provider")
    rc = bench_classifier.main(["--shapes", "40,9,16,300", "--providers", "fused", "torch",
                                "--iters", "2", "--read-bytes", str(1 << 22),
                                "--out", str(tmp_path)])
    assert rc == 0
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".csv"]
    assert path.name.startswith("classifier_")
    rows = list(csv.DictReader(open(path)))
    assert [r["provider"] for r in rows] == ["fused", "torch"]
    for r in rows:
        assert r["note"].startswith("rounds "), r["note"]
        assert r["command"].startswith("python3 benchmarks/bench_classifier.py --shapes")
        assert float(r["wall_ms"]) > 0 and float(r["read_gbps"]) > 0 and r["kernel_ms"] == ""
        # the gathered rows' bytes over the time, against the read of the median round
        gbps = 40 * 9 * 16 * 4 / float(r["wall_ms"]) / 1e6
        assert float(r["pct_read_wall"]) == pytest.approx(100 * gbps / float(r["read_gbps"]),
                                                          rel=2e-3, abs=0.06)
        assert (r["shape"], r["pass"], r["commit"] != "") == ("Q=40 k=9 D=16 N=300", "forward",
                                                             True)


def test_a_row_takes_the_median_rounds_time_and_its_own_read(tmp_path, monkeypatch):
    """The row's time and the read it is held against come from one measuring process."""
    replies = iter([{"ms": 3.0, "kernel_ms": None, "peak_mb": 1.0, "read_gbps": 40.0},
                    {"ms": 1.0, "kernel_ms": None, "peak_mb": 5.0, "read_gbps": 70.0},
                    {"ms": 2.0, "kernel_ms": None, "peak_mb": 2.0, "read_gbps": 45.0}])
    monkeypatch.setattr(bench_classifier, "run_isolated", lambda *a, **k: next(replies))
    bench_classifier.main(["--shapes", "40,9,16,300", "--providers", "torch", "--rounds", "3",
                           "--out", str(tmp_path)])
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".csv"]
    (row,) = list(csv.DictReader(open(path)))
    assert (row["wall_ms"], row["read_gbps"], row["peak_mb"]) == ("2", "45", "5.0")
