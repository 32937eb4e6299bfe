"""benchmarks/bench_threads.py: the op part runs in a fresh process per setting and writes one
line per (setting, round) with every shape and mode, and the summary against one thread."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench_threads(tmp_path, *args):
    """The lines of the log that ``bench_threads.py ARGS --out tmp_path`` wrote."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/bench_threads.py", *args,
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".txt"]
    return open(path).read().splitlines()


def test_bench_threads_op_part_writes_a_line_per_setting_and_a_summary(tmp_path):
    lines = run_bench_threads(tmp_path, "--parts", "op", "--loads", "idle", "--rounds", "1",
                              "--settings", "1", "default")
    ops = [line for line in lines if line.startswith("op load=idle")]
    assert [re.search(r"threads=(\S+)", line).group(1) for line in ops] == ["1", "default"]
    for line in ops:
        times = re.findall(r"\[(fwd|fwd_bwd) [^\]]+\]=([0-9.]+)ms", line)
        assert len(times) == 8 and all(float(ms) > 0 for _, ms in times), line
        assert "| commit " in line and "| load " in line
    summary = [line for line in lines if "threads=default load=idle op:" in line]
    assert len(summary) == 1 and "worst" in summary[0]


def test_bench_threads_interleaved_op_runs_the_settings_in_one_process(tmp_path):
    """--interleave-op: the settings take turns in one process; a line per setting as before,
    the header says how, and the default's governors report their choices."""
    lines = run_bench_threads(tmp_path, "--parts", "op", "--loads", "idle", "--rounds", "1",
                              "--settings", "1", "default", "--interleave-op", "--op-iters",
                              "4", "--op-block", "2")
    assert "op interleaved in one process (4 calls per setting in turns of 2)" in lines[0]
    ops = [line for line in lines if line.startswith("op load=idle")]
    assert [re.search(r"threads=(\S+)", line).group(1) for line in ops] == ["1", "default"]
    for line in ops:
        times = re.findall(r"\[(fwd|fwd_bwd) [^\]]+\]=([0-9.]+)ms", line)
        assert len(times) == 8 and all(float(ms) > 0 for _, ms in times), line
    assert "governors={}" in ops[0] and "governors={'forward'" in ops[1]


def test_bench_threads_refuses_bad_op_counts():
    proc = subprocess.run([sys.executable, "benchmarks/bench_threads.py", "--parts", "op",
                           "--op-block", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--op-block" in proc.stderr
    for bad in ("0", "x", "-2"):
        proc = subprocess.run([sys.executable, "benchmarks/bench_threads.py", "--settings", bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "thread count >= 1" in proc.stderr, bad


def test_bench_threads_eval_part_times_an_evaluation_per_setting(tmp_path):
    """--parts eval: one evaluate per setting in a fresh process, a line each (the default's
    line names the search's governors), and its summary against one thread. A setting may be
    any fixed count (gpu_session's threads_room passes the machine's CPU count)."""
    lines = run_bench_threads(tmp_path, "--parts", "eval", "--loads", "idle", "--settings", "1",
                              "default", "3", "--eval-n", "600")
    evals = [line for line in lines if line.startswith("eval load=idle")]
    assert [re.search(r"threads=(\S+)", line).group(1) for line in evals] == ["1", "default",
                                                                              "3"]
    evals = evals[:2]
    for line in evals:
        (ms,) = re.findall(r"\[evaluate N=600\]=([0-9.]+)ms", line)
        assert float(ms) > 0
    assert "governors={}" in evals[0] and "'knn_select'" in evals[1] and "'gemm'" in evals[1]
    assert any("threads=default load=idle eval:" in line for line in lines)
    bad = subprocess.run([sys.executable, "benchmarks/bench_threads.py", "--parts", "eval",
                          "--eval-n", "100"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--eval-n" in bad.stderr
