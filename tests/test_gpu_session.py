"""benchmarks/gpu_session.sh: one device call's work within its time, each step under its own
limit, bringing back what a device call can bring back (two files in $OUT); its smoke run on
the CPU; and bench_train_step.py, the training step it times."""
import csv
import os
import re
import stat
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_train_step  # noqa: E402

STEPS = ["env", "tests_cuda", "loss", "train_step", "long_lists"]
needs_bash = pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")


def _limits():
    """{step: seconds} of the GPU run (the smoke run's stand-in step left out)."""
    text = open(SCRIPT).read()
    return {name: int(secs) for name, secs, cmd in
            re.findall(r"^\s*step (\w+) (\d+) (\S+)", text, flags=re.M) if cmd != "echo"}


def test_the_limits_fit_a_device_call_with_room_to_spare():
    """The limits add up to at most 420 s, 70% of a 600-second call (the machine's start and
    the transfers beside them), and the cuda tests have the largest share."""
    limits = _limits()
    assert list(limits) == STEPS
    assert sum(limits.values()) <= 420, limits
    assert limits["tests_cuda"] == max(limits.values()) >= 200


def _stand_in_python(tmp_path):
    """A python3 that records its arguments, one line per call (its own newlines made spaces)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/sh\necho \"$NNKLOSS_COMMIT $*\" | tr '\\n' ' ' >> {calls}\n"
                    f"echo >> {calls}\necho ran\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return calls, dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", NNKLOSS_COMMIT="abc1234")


@needs_bash
def test_every_step_runs_in_order_and_two_files_come_back(tmp_path):
    """With python3 stood in: the cuda tests, then the loss at the benchmark shapes, the
    training step at its defaults, K 1000 at D 2048 over a bf16 bank; each on CUDA, each with
    its log, the two bench_loss runs under two names; $OUT gets the packed directory and the
    summary only."""
    calls, env = _stand_in_python(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    env["OUT"] = str(out)
    subprocess.run(["bash", SCRIPT, str(work)], env=env, check=True, capture_output=True,
                   timeout=60)
    assert sorted(os.listdir(out)) == ["gpu_session.tgz", "summary.txt"]
    lines = calls.read_text().splitlines()
    assert all(line.startswith("abc1234 ") for line in lines)
    assert [line.split()[1] for line in lines] == [
        "-c", "-m", "benchmarks/bench_loss.py", "benchmarks/bench_train_step.py",
        "benchmarks/bench_loss.py"]
    tests, loss, train, long = lines[1:]
    assert "pytest -q -m cuda tests" in tests
    assert all("--device cuda" in line for line in (loss, train, long))
    assert "--B 4096 --K 100 --D 128 512 --dtype fp32 bf16 --N 1000000" in loss
    assert "--providers fused module_unchecked compile eager" in loss
    assert "--modes fwd bwd fwd_bwd --name loss" in loss
    assert "--K 1000 --D 2048 --dtype bf16" in long and "--name long_lists" in long
    assert "--providers fused module_unchecked compile eager" in long
    assert train.split()[2:] == ["--device", "cuda", "--out", str(work)]  # its defaults
    with tarfile.open(out / "gpu_session.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {f"{step}.log" for step in STEPS} <= names
    summary = (out / "summary.txt").read_text()
    assert summary.count("== ") == len(STEPS) and "exit 0" in summary


def test_the_training_steps_defaults_are_the_sessions_shape():
    import argparse
    seen = {}
    real = argparse.ArgumentParser.parse_args

    def stop(self, argv=None, namespace=None):
        seen.update(vars(real(self, argv, namespace)))
        raise SystemExit(0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(SystemExit):
            bench_train_step.main([])
    assert {k: seen[k] for k in ("arch", "batch", "image", "N", "K", "D")} == dict(
        arch="resnet50", batch=128, image=224, N=1_000_000, K=100, D=512)
    assert seen["providers"] == ["none", "fused", "compile", "eager", "pml"]


@needs_bash
def test_a_rerun_runs_only_the_steps_named(tmp_path):
    calls, env = _stand_in_python(tmp_path)
    env["GPU_STEPS"] = "loss long_lists"
    subprocess.run(["bash", SCRIPT, str(tmp_path / "work")], env=env, check=True,
                   capture_output=True, timeout=60)
    scripts = [line.split()[1] for line in calls.read_text().splitlines()]
    assert scripts == ["-c", "benchmarks/bench_loss.py", "benchmarks/bench_loss.py"]
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert summary.count("== ") == 3 and "tests_cuda" not in summary


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_training_step_writes_a_row_per_provider(tmp_path, monkeypatch):
    """A tiny step on the CPU: every provider's row with its time, peak memory and (beside the
    backbone alone) the loss's share; pml's row says it was skipped where the package is
    missing."""
    path = bench_train_step.main(["--device", "cpu", "--arch", "resnet18", "--batch", "2",
                                  "--image", "32", "--N", "50", "--K", "4", "--D", "8",
                                  "--warmup", "0", "--steps", "1", "--providers", "none",
                                  "fused", "eager", "pml", "--out", str(tmp_path)])
    rows = {r["provider"]: r for r in _csv(path)}
    assert os.path.basename(path).startswith("train_step_") and list(rows) == [
        "none", "fused", "eager", "pml"]
    assert rows["none"]["shape"] == "resnet18 B=2 px=32 N=50 K=4 D=8"
    assert rows["pml"]["command"].startswith("python3 benchmarks/bench_train_step.py --device")
    for prov in ("none", "fused", "eager"):
        assert float(rows[prov]["wall_ms"]) > 0 and float(rows[prov]["peak_mb"]) >= 0
        assert rows[prov]["pass"] == "both" and rows[prov]["kernel_ms"] == ""
    for prov in ("fused", "eager"):
        share = float(re.fullmatch(r"loss share (-?[\d.]+)%", rows[prov]["note"]).group(1))
        ratio = float(rows["none"]["wall_ms"]) / float(rows[prov]["wall_ms"])
        # the times are written to 4 digits (each 0.05% off at most), the share to 0.1
        assert share == pytest.approx(100 * (1 - ratio), abs=0.05 + 0.1 * ratio)
    try:
        import pytorch_metric_learning  # noqa: F401
        assert float(rows["pml"]["wall_ms"]) > 0
    except ImportError:
        assert rows["pml"]["note"] == "skipped: pytorch-metric-learning is not installed"


def test_the_training_steps_losses_agree_on_the_bank():
    """The fused module and the user's eager and compiled loss compute one loss over the
    bank's lists (the compile provider checked for its inputs, not compiled here)."""
    import argparse

    import torch
    args = argparse.Namespace(N=60, K=5, D=8, batch=6)
    losses, labels, idx = bench_train_step.make_losses(args, torch.device("cpu"))
    emb = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    import nnkloss
    with nnkloss.value_checks(False):
        fused = losses["fused"](emb, labels, idx)
    torch.testing.assert_close(losses["eager"](emb, labels, idx), fused, rtol=1e-5, atol=1e-6)
    assert losses["none"](emb, labels, idx) == emb.square().mean()


@pytest.mark.slow
@needs_bash
def test_the_smoke_run_runs_every_step_on_the_cpu(tmp_path):
    """--smoke: every benchmark step runs on the CPU at tiny shapes and writes its CSV; what
    needs a GPU (the cuda tests, the kernels alone through CUDA graphs) says it was skipped."""
    work = tmp_path / "work"
    proc = subprocess.run(["bash", SCRIPT, "--smoke", str(work)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, NNKLOSS_COMMIT="abc"))
    assert proc.returncode == 0, proc.stderr
    summary = (work / "summary.txt").read_text()
    assert summary.count("exit 0") == len(STEPS), summary
    assert "tests_cuda: skipped" in (work / "tests_cuda.log").read_text()
    for bench in ("loss", "long_lists", "train_step"):
        (path,) = work.glob(f"{bench}_*.csv")
        rows = _csv(path)
        assert rows and all(r["wall_ms"] or r["note"].startswith("skipped") for r in rows)
        assert {r["commit"] for r in rows} == {"abc"}
    assert "kernel_ms: skipped" in (work / "loss.log").read_text()
    assert {r["dtype"] for r in _csv(next(work.glob("long_lists_*.csv")))} == {"bf16"}
