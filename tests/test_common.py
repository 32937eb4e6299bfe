"""benchmarks/common.py: the commit a figure is labelled with (the rule itself:
tests/test_reporting.py), the device every benchmark checks first, the timers, peak memory
and the results table."""
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
                                    "bench_refresh", "bench_train_step", "profile_step"])
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


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_peak_rss_sees_an_allocation():
    import mmap
    rss = common.PeakRss().start()
    # 64 MiB of fresh anonymous pages, each touched: the allocator's free memory plays no part
    block = mmap.mmap(-1, 64 * 2**20)
    for off in range(0, len(block), 4096):
        block[off] = 1
    block.close()
    assert 60 < rss.peak_mb() < 200


def test_a_results_csv_is_one_runs_and_keeps_its_rows_as_they_come(tmp_path):
    """Each complete run's file replaces the last run's; until then the rows written so far
    are on disk in <path>.partial (what a run stopped by its time limit or an error leaves)."""
    path = str(tmp_path / "x.csv")
    for i in range(2):
        with common.ResultsCsv(path, ["a", "b"]) as out:
            out.write([i, "x"], echo=False)
            out.write({"a": i, "b": "y"}, echo=False)
            with open(path + ".partial") as f:
                assert f.read().splitlines() == ["a,b", f"{i},x", f"{i},y"]
    with open(path) as f:
        assert f.read().splitlines() == ["a,b", "1,x", "1,y"]
    assert not os.path.exists(path + ".partial")
    with pytest.raises(AssertionError), common.ResultsCsv(path, ["a"]) as out:
        out.write({"a": 2}, echo=False)
        out.write({"a": 3, "typo": 4})
    # a run that failed leaves its rows beside the last complete run's file, not over it
    with open(path + ".partial") as f:
        assert f.read().splitlines() == ["a", "2"]
    with open(path) as f:
        assert f.read().splitlines() == ["a,b", "1,x", "1,y"]


def test_a_table_row_holds_both_times_against_the_read():
    """The percentages of the read bandwidth: bytes per call over the wall time and over the
    kernels' time, against the read measured in the run; empty where a figure is missing."""
    row = common.table_row("loss", "fused", "both", "B=1", "fp32", wall_ms=2.0, kernel_ms=1.0,
                           peak_mb=3.25, read_bytes=4e9, read_gbps=4000.0, device="X")
    assert set(row) <= set(common.TABLE_COLUMNS)
    assert (row["pct_read_wall"], row["pct_read_kernel"]) == ("50.0", "100.0")
    assert (row["read_gb"], row["peak_mb"], row["pass"], row["device"]) == ("4", "3.2", "both",
                                                                           "X")
    bare = common.table_row("loss", "eager", "backward", "B=1", "fp32", wall_ms=2.0)
    assert bare["pct_read_wall"] == bare["kernel_ms"] == bare["pct_read_kernel"] == ""
    table = common.markdown([row, bare])
    assert table.count("\n") == 3 and "| fused | both | 2 | 1 | 3.2 | 50.0 | 100.0 |" in table


def test_the_plot_draws_each_pass_of_a_table(tmp_path):
    rows = [common.table_row("loss", p, s, "B=1", "fp32", wall_ms=w, kernel_ms=k)
            for p, s, w, k in (("fused", "forward", 1.0, 0.5), ("eager", "forward", 3.0, None),
                               ("fused", "both", 2.0, 1.5))]
    png = str(tmp_path / "t.png")
    common.plot(rows, png, "title")
    assert os.path.getsize(png) > 1000
    common.plot([], str(tmp_path / "none.png"), "title")  # nothing measured: nothing drawn
    assert not os.path.exists(tmp_path / "none.png")


def test_wall_ms_times_back_to_back_calls_per_round(monkeypatch):
    """common.wall_ms's CUDA branch with the synchronisation stood in (CPU calls return when
    done): rounds of n calls, n making a round ~2 ms, the median round over n."""
    import time

    import torch
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(1))
    calls = []

    def one_ms():
        calls.append(1)
        t = time.perf_counter()
        while time.perf_counter() - t < 1e-3:
            pass
    ms = common.wall_ms(one_ms, "cuda", reps=20, min_rounds=5)
    assert 0.9 < ms < 2.0, ms
    rounds = (len(syncs) - 2) // 2  # warm-up and n's probe: 2 syncs; each round: 2
    n, rest = divmod(len(calls) - 4, rounds)  # 3 warm-up calls and n's probe: 4 calls
    assert rounds >= 5 and rest == 0 and 1 <= n <= 2


def test_graph_ms_is_none_off_cuda():
    assert common.graph_ms(lambda: None, "cpu") is None


@pytest.mark.cuda
def test_graph_ms_takes_the_host_out_and_captures_a_backward():
    """A call whose host sleeps 2 ms around a short kernel: the loop pays the 2 ms, the graph
    does not; a forward+backward is captured whole and replayed (its gradient refilled)."""
    import time

    import torch
    x = torch.zeros(1 << 20, device="cuda")

    def slow_host():
        time.sleep(0.002)
        x.add_(1)
    assert common.wall_ms(slow_host, "cuda", reps=30) > 1.8
    assert common.graph_ms(slow_host, "cuda", reps=30, calls=5) < 0.5
    w = torch.ones(1000, device="cuda", requires_grad=True)

    def step():
        w.grad = None
        (w * w).sum().backward()
    assert common.graph_ms(step, "cuda", reps=10, calls=3) > 0


def test_cpu_name_keeps_two_cpus_of_one_model_name_apart():
    zen5 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\nprocessor\t: 1\n"
            "cpu family\t: 25\nmodel\t\t: 1\nmodel name\t: other\n")
    assert common.cpu_name(zen5) == "AMD EPYC family 26 model 2"  # the first CPU's block
    assert common.cpu_name(zen5.replace("cpu family\t: 26\n", "cpu family\t: 25\n")) != \
        common.cpu_name(zen5)
    assert common.cpu_name("model name\t: Neoverse-V2\nflags\t: fp\n") == "Neoverse-V2"
    assert common.cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\n") == "cpu"
    assert common.slug(common.cpu_name(zen5)) == "AMD_EPYC_family_26_model_2"


def test_tensor_read_gbps_reads_any_dtype_where_it_lives():
    import torch
    for t in (torch.randn(300, 7), torch.randn(301, 3).bfloat16(),
              torch.arange(9, dtype=torch.int16)):
        assert common.tensor_read_gbps(t, iters=3) > 0
    assert common.tensor_read_gbps(torch.ones(1, dtype=torch.int16)) is None
