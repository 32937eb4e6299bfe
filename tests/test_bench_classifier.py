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
    from nnkloss.ops import cpu
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
    from nnkloss.ops import cpu
    if not cpu.available():
        pytest.skip("no C++ compiler: no fused provider")
    rc = bench_classifier.main(["--shapes", "40,9,16,300", "--providers", "fused", "torch",
                                "--iters", "2", "--read-bytes", str(1 << 22),
                                "--out", str(tmp_path)])
    assert rc == 0
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".csv"]
    rows = list(csv.DictReader(open(path)))
    assert [r["provider"] for r in rows] == ["fused", "torch"]
    for r in rows:
        assert not r["error"], r["error"]
        assert float(r["ms"]) > 0 and float(r["read_gb_s"]) > 0
        # the gathered rows' bytes over the time: gb_s is rounded to 2 decimals and ms to 3
        # (at ~0.05 ms that alone moves the quotient by 1%), so gb_s must lie within the
        # quotients of the times that round to ms, widened by gb_s's own rounding
        ms = float(r["ms"])
        lo = 40 * 9 * 16 * 4 / (ms + 0.0005) / 1e6 - 0.005
        hi = 40 * 9 * 16 * 4 / max(ms - 0.0005, 1e-9) / 1e6 + 0.005
        assert lo - 1e-9 <= float(r["gb_s"]) <= hi + 1e-9, (r["gb_s"], ms)
        assert r["pct_of_gather"] != "" and r["commit"] and r["date"]
        assert (r["Q"], r["k"], r["D"], r["N"]) == ("40", "9", "16", "300")


def test_a_row_takes_the_median_rounds_time_and_its_own_limits():
    """The row's ms and the limits it is held against come from one measuring process."""
    runs = [{"ms": 3.0, "limits": {"read_gbps": 40.0}},
            {"ms": 1.0, "limits": {"read_gbps": 70.0}},
            {"ms": 2.0, "limits": {"read_gbps": 45.0}}]
    assert bench_classifier.median_run(runs) is runs[2]
    assert bench_classifier.median_run(runs[:2]) is runs[0]  # the upper of an even count
