"""benchmarks/gpu_session.sh: one device call's work, within a session's GPU time, bringing back
what a device call can bring back (a few files in $OUT)."""
import os
import re
import stat
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")


def test_the_steps_time_out_within_530_seconds():
    """Within a device call's 570 s, and with a machine's start (30-40 s on the H100, up to 2
    minutes) over a quarter of the session's 15 minutes left (the whole run took 392 s of its
    then 510 s of limits on an H200 at ea8736c)."""
    text = open(SCRIPT).read()
    limits = [int(s) for s in re.findall(r"^step \w+ (\d+) ", text, flags=re.M)]
    assert len(limits) >= 5 and sum(limits) <= 530, limits


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def _stand_in_python(tmp_path):
    """A python3 that records its arguments, one line per call (its own newlines made spaces)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    # one line per call, the arguments' own newlines (python3 -c "...") made spaces
    fake.write_text(f"#!/bin/sh\necho \"$NNKLOSS_COMMIT $*\" | tr '\\n' ' ' >> {calls}\n"
                    f"echo >> {calls}\necho ran\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return calls, dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", NNKLOSS_COMMIT="abc1234")


def _named_steps(tmp_path, steps):
    """The stand-in python3's calls (one line each) of a run with GPU_STEPS=``steps``, its
    directory tmp_path / "work"."""
    calls, env = _stand_in_python(tmp_path)
    env["GPU_STEPS"] = steps
    subprocess.run(["bash", SCRIPT, str(tmp_path / "work")], env=env, check=True,
                   capture_output=True, timeout=60)
    return calls.read_text().splitlines()


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_every_step_runs_and_two_files_come_back(tmp_path):
    """With python3 stood in, every step runs in order, each writes its log, and $OUT receives
    the packed directory and the summary only."""
    calls, env = _stand_in_python(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    env["OUT"] = str(out)
    subprocess.run(["bash", SCRIPT, str(work)], env=env, check=True, capture_output=True,
                   timeout=60)
    assert sorted(os.listdir(out)) == ["gpu_session.tgz", "summary.txt"]
    lines = calls.read_text().splitlines()
    assert all(line.startswith("abc1234 ") for line in lines)
    scripts = [line.split()[1] for line in lines]
    assert scripts == ["-c", "-m", "benchmarks/bench_loss.py", "benchmarks/bench_loss.py",
                       "benchmarks/bench_loss.py", "benchmarks/profile_step.py",
                       "benchmarks/tune_loss.py", "benchmarks/tune_loss.py",
                       "benchmarks/tune_loss.py", "benchmarks/tune_loss.py",
                       "benchmarks/bench_loss.py"]
    assert all("--device cuda" in line for line in lines[2:])
    # every bench_loss step times as a training loop sees it (common.wall_ms)
    assert all("--timer wall" in line for line in lines if "bench_loss.py" in line)
    assert "--also-grad sigma centres" in lines[3] and "reduce-overhead" in lines[4]
    # the module's call under CUDA graphs beside the op's and the eager loss's
    assert "--providers compile fused_compile module_compile" in lines[4]
    # the module's lists by the one-launch kernel and by torch's ops, in the same run
    assert "--providers fused module module_torch_lists" in lines[5]
    # four runs of bench_loss: four folders, so that their CSVs do not mix
    bench = [line for line in lines if "bench_loss.py" in line]
    assert len({line.split("--out ")[1].split()[0] for line in bench}) == 4
    with tarfile.open(out / "gpu_session.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    for step in ("env", "tests_cuda", "bench_loss", "bench_grads", "bench_graphs",
                 "profile_step", "tune_loss", "tune_small", "tune_small_d128", "tune_fwd",
                 "bench_small"):
        assert f"{step}.log" in names
    summary = (out / "summary.txt").read_text()
    assert summary.count("== ") == 11 and "exit 0" in summary
    # the small batch of the real-data protocol, swept and then timed through the op
    assert "--B 128 --K 1000" in lines[-4] and "--B 128 --K 1000" in lines[-1]
    # the B 128 sweeps take 8 warps (16 per SM on sm_80/90 at the same tiles) beside 2 and 4
    assert all("--warps 2 4 8" in line for line in lines[-4:-2])
    # the forward-only build swept at the large batch
    assert "--forward-only" in lines[-2] and "--B 4096" in lines[-2]


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_a_rerun_runs_only_the_steps_named(tmp_path):
    calls, env = _stand_in_python(tmp_path)
    env["GPU_STEPS"] = "bench_loss tune_loss"
    subprocess.run(["bash", SCRIPT, str(tmp_path / "work")], env=env, check=True,
                   capture_output=True, timeout=60)
    scripts = [line.split()[1] for line in calls.read_text().splitlines()]
    assert scripts == ["-c", "benchmarks/bench_loss.py", "benchmarks/tune_loss.py"]
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert summary.count("== ") == 3 and "tests_cuda" not in summary


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_the_search_steps_run_only_when_named(tmp_path):
    """tests_search, bench_refresh and bench_eval are left out of the default run (its limits
    already fill a call; the first test above lists every script it runs) and run when
    GPU_STEPS names them: the search's cuda tests, the kNN graph on the GPU, and the evaluation
    at 150K on the GPU and then on the CPU."""
    lines = _named_steps(tmp_path, "tests_search bench_refresh bench_eval")
    assert [line.split()[1] for line in lines] == [
        "-c", "-m", "benchmarks/bench_refresh.py", "benchmarks/bench_eval.py",
        "benchmarks/bench_eval.py"]
    assert "-m cuda" in lines[1] and "tests/test_search.py" in lines[1]
    assert "--device cuda" in lines[2] and "--N 100000 1000000" in lines[2]
    assert "--N 150000" in lines[3] and "--device cuda" in lines[3]
    assert "--device" not in lines[4]
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert summary.count("== ") == 4 and "tests_cuda" not in summary


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_the_governors_room_is_timed_on_the_devices_cpu_only_when_named(tmp_path):
    """threads_room: the evaluation of 60,000 points idle and beside a 2-thread process at one
    thread, at the machine's CPU count fixed and governed, only when GPU_STEPS names it."""
    lines = _named_steps(tmp_path, "threads_room")
    assert [line.split()[1] for line in lines] == ["-c", "benchmarks/bench_threads.py"]
    cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    assert f"--settings 1 {cpus} default" in lines[1] and "--parts eval" in lines[1]
    assert "--loads idle matmul2" in lines[1] and "--eval-n 60000" in lines[1]


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_the_cpu_evaluation_runs_at_1_to_16_threads_only_when_named(tmp_path):
    """eval_threads: the evaluation at 150K on the device's CPU at 1-16 threads with its
    search's parts timed, only when GPU_STEPS names it; env.log records the host's CPU."""
    lines = _named_steps(tmp_path, "eval_threads")
    assert [line.split()[1] for line in lines] == ["-c", "benchmarks/bench_eval.py"]
    assert "--threads 1 2 4 8 16 --phases" in lines[1] and "--N 150000" in lines[1]
    assert "--device" not in lines[1]
    # fixed counts: the search's governors off
    assert "NNKLOSS_GOVERN_THREADS=0" in open(SCRIPT).read().split("extra eval_threads")[1]
    if os.path.exists("/usr/bin/lscpu"):
        assert "CPU(s):" in (tmp_path / "work" / "env.log").read_text()
