"""benchmarks/common.py: the commit a figure is labelled with (the rule itself:
tests/test_reporting.py), and the device every benchmark checks first."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common  # noqa: E402


def test_git_commit_reads_the_override(monkeypatch):
    """benchmarks/gpu_session.sh passes the commit in: the device machine's tree has no .git."""
    monkeypatch.setenv("NNKLOSS_COMMIT", "feedbee")
    assert common.git_commit() == "feedbee"
    monkeypatch.delenv("NNKLOSS_COMMIT")
    assert common.git_commit() != "feedbee"


def test_git_commit_outside_a_checkout_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("NNKLOSS_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert common.git_commit(str(tmp_path)) == "unknown"


@pytest.mark.parametrize("script", ["bench_classifier", "bench_eval", "bench_loss",
                                    "bench_refresh", "profile_step", "tune_loss"])
def test_every_benchmark_checks_its_device_before_any_work(script):
    """--device through common.parse_device: a name that is no device, or CUDA where there is
    none, is the parser's error naming --device (exit 2), not torch's at the first tensor."""
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    for device, message in (("gpu", "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
                            ("cuda", "--device cuda: CUDA is not available")):
        proc = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--device", device],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (device, proc.stderr[-500:])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_peak_rss_counts_a_warmed_up_calls_memory():
    """The measured call after a warm-up (bench_classifier's peak_mb, bench_loss's backward):
    memory the warm-up freed but the C heap kept resident served the call without raising the
    RSS, and its 3.8 MiB read 0.0 MiB (the classifier's fused peaks below their outputs)."""
    import torch

    def call():
        return float(torch.ones(1_000_000).sum())  # 3.8 MiB, freed on return

    call()
    meter = common.PeakRss().start()
    call()
    assert meter.peak_mb() >= 3.5
