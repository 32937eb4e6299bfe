"""The loss benchmark's eager provider is right, a CPU smoke run writes the CSV and plot (in
process and with every measurement in a fresh process), and the shared helpers work."""
import argparse
import csv
import math
import mmap
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_loss  # noqa: E402
import common  # noqa: E402

import nnkloss  # noqa: E402


def test_eager_provider_matches_fused_op():
    inputs = bench_loss.make_inputs(6, 5, 7, 50, torch.float32, torch.device("cpu"))
    emb, labels, centres, cl, nb, w, sigma = inputs
    nb[0, 1:] = -1
    a = bench_loss.eager_loss(emb, labels, centres, cl, nb, w, sigma)
    b = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma, backend="torch")
    torch.testing.assert_close(a, b)


def test_checked_and_module_providers_compute_the_fused_loss():
    """The two providers of the user's default calls give the same loss and embedding
    gradient as ``fused`` (same lists, the own centre kept), and run with the value checks on
    whatever the caller's setting; module_unchecked the same loss with them off."""
    inputs = list(bench_loss.make_inputs(64, 6, 9, 400, torch.float32, torch.device("cpu")))
    own = torch.randperm(400, generator=torch.Generator().manual_seed(5))[:64]
    inputs[4][:, 0] = own.to(inputs[4])  # distinct own rows: the bank holds every list
    inputs[1] = inputs[3][own]
    inputs[0] = inputs[2][own] + 0.1
    module = bench_loss.module_loss(inputs)
    unchecked = bench_loss.module_loss(inputs, checks=False)
    results = []
    for fn in (bench_loss.fused_loss, bench_loss.checked_loss, module, unchecked):
        x = inputs[0].clone().requires_grad_(True)
        with nnkloss.value_checks(False):
            loss = fn(x, *inputs[1:])
        loss.backward()
        results.append((loss.detach(), x.grad))
    assert results[0][1].abs().sum() > 0
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-9)
    bad = list(inputs)
    bad[0] = inputs[0].clone()
    bad[0][3, 1] = float("nan")
    with nnkloss.value_checks(False), pytest.raises(ValueError, match="emb contains NaN"):
        bench_loss.checked_loss(*bad)
    bad = list(inputs)
    bad[1] = inputs[1] + 1  # labels that disagree with the bank's
    with nnkloss.value_checks(False), pytest.raises(ValueError, match="labels disagree"):
        module(*bad)
    # module_unchecked: the checks off even where the caller has them on (the training loop's
    # later steps): the disagreeing rows are dropped, not raised
    with nnkloss.value_checks(True):
        assert torch.isfinite(unchecked(*bad))


def test_cpu_smoke_run_writes_csv_and_plot(tmp_path, monkeypatch):
    # The run's own read (the "read" row) and the read each measuring process takes beside its
    # calls (_limits) told apart by their sizes: the rows are held against the latter.
    monkeypatch.setattr(bench_loss, "PROCESS_READ_BYTES", 2 ** 22)
    fake = lambda device, nbytes=2 ** 30: 40.0 if nbytes == 2 ** 22 else 25.0  # noqa: E731
    monkeypatch.setattr(bench_loss, "read_gbps", fake)  # the run's own read
    monkeypatch.setattr(common, "read_gbps", fake)  # common.process_limits' read
    path = bench_loss.main(["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N",
                            "40", "--dtype", "fp32", "bf16", "--providers", "fused", "eager",
                            "--no-isolate", "--out", str(tmp_path)])
    assert nnkloss.validation.value_checks_enabled(), "the benchmark leaves the setting as it was"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == bench_loss.COLUMNS
    read = [r for r in rows if r["op"] == "read"]
    rows = [r for r in rows if r["op"] == "loss"]
    assert len(read) == 1 and float(read[0]["read_gbps"]) == 25.0
    assert len(rows) == 2 * 3 * 2  # dtypes x modes (fwd, bwd, fwd_bwd) x providers
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    for r in rows:
        assert float(r["read_gbps"]) == 40.0 and r["load"] and r["date"]
        if r["mode"] == "bwd":
            assert r["pct_of_read"] == "" and r["gathered_gbps"] == ""
            continue
        esize = 4 if r["dtype"] == "fp32" else 2
        gathered = 4 * 3 * 5 * esize / float(r["ms"]) / 1e6
        # The CSV holds percentages to 0.1 (0.05 off) computed before ms and the limits were
        # rounded to 4 digits (another 0.1% here): 0.06 covers both.
        assert float(r["gathered_gbps"]) == pytest.approx(gathered, rel=1e-3)
        assert float(r["pct_of_read"]) == pytest.approx(
            100 * gathered / float(r["read_gbps"]), rel=1e-2, abs=0.06)
        bank = float(r["bank_read_gbps"])  # one bank per dtype, shared by the providers
        assert bank > 0 and float(r["pct_of_bank_read"]) == pytest.approx(
            100 * gathered / bank, rel=1e-2, abs=0.06)
        gather = float(r["gather_gbps"])  # the rows the lists name, read in their order
        assert gather > 0 and float(r["pct_of_gather"]) == pytest.approx(
            100 * gathered / gather, rel=1e-2, abs=0.06)
    assert os.path.getsize(path.replace(".csv", ".png")) > 1000
    table = bench_loss.summary(path, rows[0]["commit"])
    head = table.splitlines()[0]
    for col in ("forward ms", "backward ms", "forward+backward ms", "forward MB",
                "backward MB", "forward+backward MB", "forward % of read",
                "forward+backward % of read", "forward % of gather",
                "forward+backward % of gather"):
        assert f"| {col} |" in head, col
    assert table.count("| fused |") == 2 and table.count("| eager |") == 2
    assert "fused vs eager, forward+backward" in table


def test_copy_bandwidth_row_fills_the_csv_columns(tmp_path, monkeypatch):
    """--copy-bandwidth (the GPU session's limit): its row has every column of the CSV."""
    monkeypatch.setattr(bench_loss, "measure_copy_gbps", lambda device: 1234.5)
    path = bench_loss.main(["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N", "40",
                            "--dtype", "fp32", "--providers", "fused", "--modes", "fwd",
                            "--no-isolate", "--copy-bandwidth", "--out", str(tmp_path)])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    (copy,) = [r for r in rows if r["op"] == "copy"]
    assert copy["gbps"] == "1234.5" and copy["device"] and copy["date"] and copy["commit"]
    assert None not in copy.values() and [r["op"] for r in rows].count("loss") == 1


def test_also_grad_trains_sigma_weights_and_centres_and_labels_the_rows(tmp_path, monkeypatch):
    """--also-grad: the backward modes also give a gradient to a learned sigma, the weights and
    the centres (leaves cleared before each backward); the rows say so in "grads", and the
    summary keeps runs of different gradients apart."""
    seen = []
    real = bench_loss.fused_loss

    def spy(emb, labels, centres, cl, nb, w, sigma):
        loss = real(emb, labels, centres, cl, nb, w, sigma)
        seen.append((emb.requires_grad, sigma.requires_grad, w.requires_grad,
                     centres.requires_grad))
        return loss
    monkeypatch.setattr(bench_loss, "fused_loss", spy)
    common = ["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N", "40", "--dtype",
              "fp32", "--providers", "fused", "--no-isolate", "--out", str(tmp_path)]
    bench_loss.main(common)
    assert set(seen) == {(False, False, False, False), (True, False, False, False)}
    seen.clear()
    path = bench_loss.main(common + ["--also-grad", "sigma", "centres"])
    assert set(seen) == {(False, False, False, False), (True, True, False, True)}
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss"]
    assert [r["grads"] for r in rows] == ["", "emb", "emb", "", "emb+sigma+centres",
                                        "emb+sigma+centres"]
    commit = rows[0]["commit"]
    plain, extra = (bench_loss.summary(path, commit, grads=g)
                    for g in ("emb", "emb+sigma+centres"))
    assert "Gradients to" not in plain and "Gradients to: emb, sigma, centres." in extra
    assert plain.count("| fused |") == extra.count("| fused |") == 1
    with pytest.raises(ValueError, match="module provider trains the embeddings only"):
        bench_loss.run_one("module", "bwd", bench_loss.make_inputs(4, 3, 5, 40, torch.float32,
                                                                   torch.device("cpu")),
                           torch.device("cpu"), 1, ["sigma"])


def test_isolated_run_measures_time_and_peak_memory(tmp_path):
    path = bench_loss.main(["--device", "cpu", "--B", "16", "--K", "8", "--D", "32", "--N",
                            "100", "--dtype", "bf16", "--providers", "fused", "torch",
                            "--modes", "fwd_bwd", "--out", str(tmp_path)])
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss"]
    assert [r["provider"] for r in rows] == ["fused", "torch"]
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["peak_mem_mb"]) >= 0
        assert r["commit"] and r["device"]


def test_repeats_interleave_providers_and_keep_the_median_round(tmp_path, monkeypatch):
    order = []
    real = bench_loss.run_one

    def spy(prov, mode, *a):
        order.append((prov, mode))
        return real(prov, mode, *a)
    monkeypatch.setattr(bench_loss, "run_one", spy)
    path = bench_loss.main(["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N", "40",
                            "--dtype", "fp32", "--providers", "fused", "eager", "--modes",
                            "fwd", "--repeats", "3", "--no-isolate", "--out", str(tmp_path)])
    assert order == [("fused", "fwd"), ("eager", "fwd")] * 3
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss"]
    assert [r["provider"] for r in rows] == ["fused", "eager"]
    runs = [({"fwd": {"ms": v, "peak": p, "first_ms": 9.0}}, torch.int32,
             {"bank_read_gbps": g, "gather_gbps": h})
            for v, p, g, h in ((3.0, 1.0, 50.0, 9.0), (1.0, 4.0, None, None),
                               (2.0, 2.0, 70.0, 8.0))]
    per_mode, idx = bench_loss.combine_repeats(runs)
    assert per_mode["fwd"]["ms"] == 2.0 and per_mode["fwd"]["peak"] == 4.0
    assert per_mode["fwd"]["rounds"] == [3.0, 1.0, 2.0] and idx == torch.int32
    # the limits of the median round's own process, not the best of the rounds
    assert per_mode["fwd"]["limits"] == {"bank_read_gbps": 70.0, "gather_gbps": 8.0}
    runs[2][0]["fwd"]["ms"] = 4.0  # now the first round is the median
    assert bench_loss.combine_repeats(runs)[0]["fwd"]["limits"] == {"bank_read_gbps": 50.0,
                                                                    "gather_gbps": 9.0}
    runs[1][0]["fwd"] = {"oom": True}
    assert bench_loss.combine_repeats(runs)[0]["fwd"] == {"oom": True}


def test_cpu_default_grid_is_the_issue_shapes():
    none = argparse.Namespace(B=None, K=None, D=None, N=None, dtype=None)
    assert bench_loss.shapes(none, torch.device("cpu")) == bench_loss.CPU_GRID
    assert len(bench_loss.shapes(none, torch.device("cuda"))) == 2 * 27
    some = argparse.Namespace(B=[4], K=[3], D=[5], N=40, dtype=None)
    assert bench_loss.shapes(some, torch.device("cpu")) == [(4, 3, 5, 40, "fp32"),
                                                            (4, 3, 5, 40, "bf16")]


def test_peak_rss_sees_an_allocation_and_csv_header_is_written_once(tmp_path):
    import common
    rss = common.PeakRss().start()
    # 64 MiB of fresh anonymous pages, each touched: the allocator's free memory (which
    # torch.ones could reuse, resident already, after earlier tests: a peak of 0.0 once in
    # five runs of a test subset) plays no part
    block = mmap.mmap(-1, 64 * 2**20)
    for off in range(0, len(block), 4096):
        block[off] = 1
    block.close()
    assert 60 < rss.peak_mb() < 200
    path = str(tmp_path / "x.csv")
    for i in range(2):
        with common.ResultsCsv(path, ["a", "b"]) as out:
            out.write([i, "x"], echo=False)
            out.write({"a": i, "b": "y"}, echo=False)
    with open(path) as f:
        assert f.read().splitlines() == ["a,b", "0,x", "0,y", "1,x", "1,y"]
    # a later version of the script with one more column: the old rows move to the new header
    with common.ResultsCsv(path, ["a", "b", "c"]) as out:
        out.write([2, "z", 3.5], echo=False)
    with open(path) as f:
        assert f.read().splitlines() == ["a,b,c", "0,x,", "0,y,", "1,x,", "1,y,", "2,z,3.5"]


def test_cpu_name_keeps_two_cpus_of_one_model_name_apart():
    import common
    zen5 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\nprocessor\t: 1\n"
            "cpu family\t: 25\nmodel\t\t: 1\nmodel name\t: other\n")
    assert common.cpu_name(zen5) == "AMD EPYC family 26 model 2"  # the first CPU's block
    assert common.cpu_name(zen5.replace("cpu family\t: 26\n", "cpu family\t: 25\n")) != \
        common.cpu_name(zen5)
    # no family / model lines (e.g. aarch64): the model name alone; no model name: "cpu"
    assert common.cpu_name("model name\t: Neoverse-V2\nflags\t: fp\n") == "Neoverse-V2"
    assert common.cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\n") == "cpu"
    assert common.slug(common.cpu_name(zen5)) == "AMD_EPYC_family_26_model_2"


def test_tensor_read_gbps_reads_any_dtype_where_it_lives():
    import common
    for t in (torch.randn(300, 7), torch.randn(301, 3).bfloat16(),
              torch.arange(9, dtype=torch.int16)):
        assert common.tensor_read_gbps(t, iters=3) > 0
    assert common.tensor_read_gbps(torch.ones(1, dtype=torch.int16)) is None


def test_tuner_candidates_reach_128_rows_within_128_elements_a_thread():
    """The small batch's long tiles are swept (128 x 64 at 4 warps, the rule's tile at B 128),
    but none that holds more than 128 elements a thread (128 x 64 at one warp spilled)."""
    import tune_loss
    from nnkloss.ops.backends import kernels
    cfgs = list(tune_loss.candidate_configs(1000, 64, kernels().FwdConfig, (1, 2, 4)))
    tiles = {(c.block_k, c.num_warps) for c in cfgs}
    assert {(128, 4), (128, 2), (64, 1)} <= tiles and (128, 1) not in tiles
    assert all(c.block_k * c.block_d <= 128 * 32 * c.num_warps for c in cfgs)


@pytest.mark.interpreter
def test_tuner_smoke_run_checks_every_config(tmp_path):
    import tune_loss
    path, summary = tune_loss.main(["--device", "cpu", "--B", "2", "--K", "5", "--D", "8",
                                    "--N", "30", "--dtype", "fp32", "--max-configs", "4",
                                    "--out", str(tmp_path)])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == tune_loss.COLUMNS
    # the 4 configs, then the default's tile with the next tile's entries prefetched
    assert len(rows) == 5 and all(r["ok"] == "1" for r in rows)
    assert [r["prefetch_index"] for r in rows] == ["0"] * 4 + ["1"]
    assert rows[0]["block_d"] == "8"  # the single pass over the row is tried first
    assert len({r["default_ms"] for r in rows}) == 1  # the faster of the default's two times
    assert len(summary) == 1 and summary[0][5] > 0 and summary[0][5] <= summary[0][4]
    assert {r["build"] for r in rows} == {"train"}
    assert {r["timer"] for r in rows} == {"graph"}  # the default (on CPU: common.time_ms)


@pytest.mark.interpreter
@pytest.mark.parametrize("added", [3, 2, 1])
def test_tuner_sweeps_the_forward_only_build_into_an_older_file(tmp_path, added):
    """--forward-only times the build without grad_x and checks its outputs against the
    forward-only default; a file from before the build, timer and prefetch_index columns
    (added = 3), the last two (2) or the last (1) gets them (its rows: "train", "do_bench",
    0); --timer do_bench is recorded."""
    import tune_loss
    path = tmp_path / "tune_AMD_EPYC.csv"  # any existing file of an older format
    old = tune_loss.COLUMNS[:-added]
    path.write_text(",".join(old) + "\n" + ",".join(["1"] * len(old)) + "\n")
    from unittest import mock
    with mock.patch.object(tune_loss, "device_name", lambda device: "AMD EPYC"):
        out, summary = tune_loss.main(["--device", "cpu", "--B", "2", "--K", "5", "--D", "8",
                                       "--N", "30", "--dtype", "fp32", "--max-configs", "2",
                                       "--forward-only", "--timer", "do_bench",
                                       "--out", str(tmp_path)])
    assert out == str(path)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == tune_loss.COLUMNS
    assert [r["build"] for r in rows] == ["train" if added == 3 else "1"] + ["fwd"] * 3
    assert [r["timer"] for r in rows] == ["do_bench" if added >= 2 else "1"] + ["do_bench"] * 3
    assert [r["prefetch_index"] for r in rows] == ["0", "0", "0", "1"]
    assert all(r["ok"] == "1" for r in rows[1:])
    bad = tmp_path / "tune_other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unexpected columns"):
        tune_loss._upgrade(str(bad))


@pytest.mark.cuda
def test_kernel_ms_takes_the_host_out():
    """common.kernel_ms times the device's work only: 2 ms of host time around a short kernel
    are not in its figure (do_bench's includes them), and a kernel of 256 MB of writes takes
    about its bytes at a few TB/s (not 0: the flush-only graph is subtracted, not all)."""
    import time

    import common
    x = torch.zeros(64 << 20, device="cuda")  # 256 MB

    def slow_host():
        time.sleep(0.002)
        x.add_(1)
    ms = common.kernel_ms(slow_host, "cuda", reps=50, calls=5)
    assert 0.01 < ms < 1.0, ms  # 512 MB moved: ~0.1-0.3 ms on an H100 / H200
    # 3 warm-up calls, then 5 calls a replay: the warm replay and at least 5 timed ones
    assert x[0] >= 3 + 5 * 6
    assert common.time_ms(slow_host, "cuda", reps=50) > 1.5


def test_wall_ms_times_back_to_back_calls_per_round(monkeypatch):
    """common.wall_ms's CUDA branch with the synchronisation stood in (CPU calls return when
    done): rounds of n calls, n making a round ~2 ms, the median round over n. A call that
    takes 1 ms of host time comes out near 1 ms, and so does its per-round count."""
    import time

    import common
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
    assert rounds >= 5 and rest == 0 and 1 <= n <= 2  # ~2 ms a round of 1 ms calls


@pytest.mark.cuda
def test_wall_ms_sees_the_host_kernel_ms_does_not():
    """A call whose host takes 2 ms around a short kernel: the loop pays the 2 ms."""
    import time

    import common
    x = torch.zeros(1 << 20, device="cuda")

    def slow_host():
        time.sleep(0.002)
        x.add_(1)
    assert common.wall_ms(slow_host, "cuda", reps=30) > 1.8
    assert common.kernel_ms(slow_host, "cuda", reps=30, calls=5) < 0.5


def test_bench_loss_timer_reaches_the_cuda_branch_and_the_csv(tmp_path, monkeypatch):
    """--timer wall: the fwd and fwd_bwd modes of a CUDA run are timed by common.wall_ms (the
    CUDA branch stood in on CPU tensors) and the CSV says so; a CPU run writes "median"."""
    seen = []
    monkeypatch.setattr(bench_loss, "wall_ms", lambda fn, device, reps: seen.append(1) or 1.0)
    monkeypatch.setitem(bench_loss.TIMER, "timer", "wall")
    inputs = bench_loss.make_inputs(8, 4, 16, 100, torch.float32, torch.device("cpu"))
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)

    class FakeCuda:
        type = "cuda"
    ms, _, _ = bench_loss.run_one("fused", "fwd", inputs, FakeCuda(), reps=1)
    assert ms == 1.0 and seen == [1]
    monkeypatch.setattr(torch.cuda, "synchronize", real_sync)
    monkeypatch.setitem(bench_loss.TIMER, "timer", "do_bench")
    path = bench_loss.main(["--device", "cpu", "--B", "8", "--K", "4", "--D", "16", "--N",
                            "100", "--dtype", "fp32", "--providers", "fused", "--modes", "fwd",
                            "--no-isolate", "--timer", "wall", "--out", str(tmp_path)])
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss"]
    assert [r["timer"] for r in rows] == ["median"]


def test_kernel_ms_is_time_ms_off_cuda():
    import common
    assert common.kernel_ms(lambda: torch.ones(10).sum(), "cpu", reps=5) > 0


def test_refresh_benchmark_writes_through_the_shared_helper(tmp_path):
    import bench_refresh
    assert bench_refresh.main(["--N", "500", "--D", "8", "--k", "5", "--backends", "torch",
                               "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("refresh_*.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == bench_refresh.COLUMNS
    assert rows[0]["N"] == "500" and float(rows[0]["seconds"]) > 0 and rows[0]["date"]
    # the bound is the faster GEMM, torch.mm's rate kept beside it
    assert rows[0]["gemm"] in ("torch.mm", "library")
    assert float(rows[0]["sgemm_gflops"]) >= float(rows[0]["torch_mm_gflops"]) > 0


def test_refresh_benchmark_times_torch_mm_on_request(tmp_path, monkeypatch):
    import bench_refresh
    monkeypatch.setattr(bench_refresh.TS, "COMPILED_GEMM", True)
    assert bench_refresh.main(["--N", "300", "--D", "8", "--k", "5", "--backends", "torch",
                               "--torch-mm", "--out", str(tmp_path)]) == 0
    assert bench_refresh.TS.COMPILED_GEMM is False
    (path,) = tmp_path.glob("refresh_*.csv")
    with open(path) as f:
        (row,) = list(csv.DictReader(f))
    assert row["backend"] == "torch (torch.mm)"


def test_profile_step_reports_wall_and_host_time_per_mode(capsys):
    import profile_step
    report = profile_step.main(["--device", "cpu", "--B", "8", "--K", "4", "--D", "16", "--N",
                                "100", "--calls", "5", "--top", "5"])
    assert set(report) == {"fwd", "fwd_bwd"}
    for wall, host in report.values():
        assert wall > 0 and 0 < host <= wall * 1.01
    out = capsys.readouterr().out
    assert out.count("== fwd") == 2 and "loss_rows_unchecked" in out and "commit" in out


def test_profile_step_profiles_the_module_call_too(capsys):
    """--providers fused module: the module's call (bench_loss.module_loss, checks off) is
    profiled beside the op's, its host work visible (the bank's lists, the loss's forward)."""
    import profile_step
    report = profile_step.main(["--device", "cpu", "--B", "8", "--K", "4", "--D", "16", "--N",
                                "100", "--calls", "5", "--top", "40", "--providers", "fused",
                                "module", "--modes", "fwd"])
    assert set(report) == {"fwd", "module fwd"}
    out = capsys.readouterr().out
    module_part = out.split("== module fwd")[1]
    # the bank's lists of the batch: one call of the CPU library (batch_lists), where it is
    # built; torch's route (neighbours_for) without it
    lists = "batch_lists" if nnkloss.ops.cpu.available() else "neighbours_for"
    assert lists in module_part and lists not in out.split("== module")[0]


def test_profile_step_times_the_module_with_the_lists_by_torch(capsys, monkeypatch):
    """module_torch_lists: the module's call with the one-launch lists kernel turned off for
    that provider only (here the kernel route is stood in on CPU tensors: its calls counted)."""
    import profile_step
    from nnkloss.losses import base
    calls = []

    def stand_in(device):
        def launch(table, idx, labels, bank_labels, exclude_self):
            calls.append(1)
            nb = table[idx.long()]
            if exclude_self:
                nb = nb.masked_fill(nb == idx[:, None], -1)
            return nb, torch.zeros(2, dtype=torch.int64)
        return launch
    monkeypatch.setattr(base, "_lists_kernel", stand_in)
    report = profile_step.main(["--device", "cpu", "--B", "8", "--K", "4", "--D", "16", "--N",
                                "100", "--calls", "5", "--top", "40", "--providers", "module",
                                "module_torch_lists", "--modes", "fwd"])
    assert set(report) == {"module fwd", "module_torch_lists fwd"}
    out = capsys.readouterr().out
    assert "neighbours_for" not in out.split("== module_torch_lists")[0]
    assert "neighbours_for" in out.split("== module_torch_lists")[1]
    assert len(calls) == 3 + 5 + 5 and base._lists_kernel is stand_in


def test_profile_step_parts_time_each_piece_of_the_call(capsys):
    """--parts: each piece of the op's call timed on its own after the modes (the backend's
    forward both ways, the counted mask, the mean, autograd's round trips), in a table."""
    import profile_step
    report = profile_step.main(["--device", "cpu", "--B", "8", "--K", "4", "--D", "16", "--N",
                                "100", "--calls", "5", "--modes", "fwd", "--parts"])
    parts = {k[len("part "):]: v for k, v in report.items() if k.startswith("part ")}
    assert set(report) == {"fwd"} | {f"part {k}" for k in parts}
    assert {"backend forward, forward-only", "reduce_rows mean",
            "autograd: identity Function, .sum().backward()"} <= set(parts)
    for wall, host in parts.values():
        assert wall > 0 and 0 < host <= wall * 1.01
    table = capsys.readouterr().out.split("== parts")[1]
    assert all(f"| {name} |" in table for name in parts)


def test_module_compile_provider_compiles_the_modules_call(monkeypatch):
    """module_compile: the module's checks-off call inside torch.compile (what a user who
    compiles the module gets): the same loss and gradient as module_unchecked, compiled once
    for the modes of a shape, and under reduce-overhead nothing of the inputs is marked static
    (the module's own tensors are what a user's step holds)."""
    inputs = bench_loss.make_inputs(16, 5, 8, 60, torch.float32, torch.device("cpu"))
    seen, static = [], []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    import torch._dynamo as dynamo
    monkeypatch.setattr(dynamo, "mark_static_address", lambda t: static.append(t))
    monkeypatch.setitem(bench_loss.COMPILE_MODE, "mode", "reduce-overhead")
    bench_loss._COMPILED.clear()
    results = []
    for provider in ("module_unchecked", "module_compile"):
        for mode in ("fwd", "fwd_bwd"):
            ms, _, _ = bench_loss.run_one(provider, mode, inputs, torch.device("cpu"), reps=1)
            assert ms > 0
        fn = (bench_loss.module_loss(inputs, checks=False) if provider == "module_unchecked"
              else bench_loss._COMPILED[provider])
        x = inputs[0].clone().requires_grad_(True)
        loss = fn(x, *inputs[1:])
        loss.backward()
        results.append((loss.detach(), x.grad))
    bench_loss._COMPILED.clear()
    assert seen == [{"dynamic": False, "mode": "reduce-overhead"}] and static == []
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])


def test_fused_compile_provider_runs_the_op_inside_torch_compile(tmp_path, monkeypatch):
    """fused_compile: the op's call compiled (the op opaque inside); same loss and gradient
    as fused, and --compile-mode reaches torch.compile."""
    inputs = bench_loss.make_inputs(16, 5, 8, 60, torch.float32, torch.device("cpu"))
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    monkeypatch.setitem(bench_loss.COMPILE_MODE, "mode", "max-autotune-no-cudagraphs")
    bench_loss._COMPILED.clear()
    results = []
    for provider in ("fused", "fused_compile"):
        x = inputs[0].clone().requires_grad_(True)
        ms, _, _ = bench_loss.run_one(provider, "fwd_bwd", (x,) + inputs[1:],
                                      torch.device("cpu"), reps=1)
        assert ms > 0
        fn = bench_loss.fused_loss if provider == "fused" else bench_loss._COMPILED[provider]
        x.grad = None
        with nnkloss.value_checks(False):
            loss = fn(x, *inputs[1:])
        loss.backward()
        results.append((loss.detach(), x.grad))
    bench_loss._COMPILED.clear()
    assert seen == [{"dynamic": False, "mode": "max-autotune-no-cudagraphs"}]
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])


def test_process_limits_are_measured_where_they_are_called():
    """common.process_limits: the machine's read (of read_bytes), the bank's and the gather of
    the listed rows, all on CPU tensors; max_limits keeps each limit's largest."""
    from nnkloss.ops import cpu
    bank = torch.randn(50, 8)
    lists = torch.randint(0, 50, (4, 3))
    lim = common.process_limits(bank, lists, 2 ** 20)
    assert set(lim) == {"read_gbps", "bank_read_gbps", "gather_gbps"}
    assert lim["read_gbps"] > 0 and lim["bank_read_gbps"] > 0
    assert (lim["gather_gbps"] > 0) if cpu.available() else lim["gather_gbps"] is None
    assert common.max_limits([{"a": 1.0, "b": None}, {"a": 3.0}, None]) == {"a": 3.0, "b": None}


def test_plot_shows_one_commits_latest_rows_and_their_read_share(tmp_path):
    """The plot and the table take the same rows: one commit's, the last per shape, provider
    and mode (rows written before the "run" column count as one run), the forward and the
    trained inputs' backward rows; "% of read" is empty for the backward."""
    path = str(tmp_path / "loss.csv")

    def row(commit, prov, mode, ms, pct, grads="emb", D="128"):
        r = dict.fromkeys(bench_loss.COLUMNS, "")
        r.update(op="loss", provider=prov, mode=mode, B="8", K="4", D=D, dtype="fp32",
                 ms=str(ms), commit=commit, pct_of_read=pct, device="cpu X",
                 date="2026-11-27T00:00:00+00:00", grads="" if mode == "fwd" else grads)
        return r
    rows = [row("new", "fused", "fwd", 2.0, "50"),              # replaced below
            row("new", "fused", "fwd", 1.0, "90"),
            row("new", "compile", "fwd", 3.0, "30"),
            row("new", "fused", "bwd", 0.5, ""),
            row("new", "fused", "bwd", 7.0, "", grads="emb+sigma"),  # another --also-grad
            row("new", "fused", "fwd", 4.0, "20", D="64"),
            row("old", "fused", "fwd", 9.0, "10")]                 # another commit, later
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bench_loss.COLUMNS)
        w.writeheader()
        w.writerows(rows)
    shapes, modes, provs, ms, pct = bench_loss.plot_data(bench_loss.loss_rows(path, "new"))
    assert shapes == [("8", "4", "128", "fp32"), ("8", "4", "64", "fp32")]
    assert modes == ["fwd", "bwd"] and provs == ["fused", "compile"]
    assert ms["fwd", "fused"] == [1.0, 4.0] and pct["fwd", "fused"] == [90.0, 20.0]
    assert ms["fwd", "compile"][0] == 3.0 and math.isnan(ms["fwd", "compile"][1])
    assert ms["bwd", "fused"][0] == 0.5 and math.isnan(pct["bwd", "fused"][0])
    _, _, _, ms, _ = bench_loss.plot_data(bench_loss.loss_rows(path, "new", "emb+sigma"))
    assert ms["bwd", "fused"][0] == 7.0
    png = str(tmp_path / "loss.png")
    bench_loss.plot(path, png, "new")
    assert os.path.getsize(png) > 1000
    bench_loss.plot(path, str(tmp_path / "none.png"), "absent")  # no rows: nothing drawn
    assert not os.path.exists(tmp_path / "none.png")


def test_backward_rows_count_the_backwards_bytes(tmp_path, monkeypatch):
    """A bwd row's gbps: the backward's own bytes (grad_x read, d emb written) over its time,
    not the forward+backward's bytes over the backward's time (which counted the gathered
    centres the backward never reads)."""
    monkeypatch.setattr(bench_loss, "PROCESS_READ_BYTES", 2 ** 22)
    monkeypatch.setattr(bench_loss, "read_gbps", lambda device, nbytes=2 ** 30: 25.0)
    monkeypatch.setattr(common, "read_gbps", lambda device, nbytes=2 ** 30: 25.0)
    B, K, D = 4, 3, 5
    assert bench_loss.bytes_needed(B, K, D, torch.float32, torch.int32, "bwd") == B * D * 4 * 2
    path = bench_loss.main(["--device", "cpu", "--B", str(B), "--K", str(K), "--D", str(D),
                            "--N", "40", "--dtype", "fp32", "--providers", "fused",
                            "--modes", "bwd", "--no-isolate", "--out", str(tmp_path)])
    with open(path) as f:
        (row,) = [r for r in csv.DictReader(f) if r["op"] == "loss"]
    assert float(row["gbps"]) == pytest.approx(B * D * 4 * 2 / float(row["ms"]) / 1e6,
                                               rel=1e-3)


def test_tables_join_one_runs_rows_and_rows_record_the_compile_mode(tmp_path):
    """Two runs at one commit (fused and compile at the default mode, then compile alone with
    reduce-overhead): loss_rows kept the last row per shape, provider and mode across runs, so
    the table showed the first run's fused beside the second's compile, and no column told a
    reduce-overhead row from a default one. Now rows carry the run and the compile mode, and a
    table is one run's (the latest unless named)."""
    path = str(tmp_path / "loss.csv")

    def row(run, prov, ms, compile_mode):
        r = dict.fromkeys(bench_loss.COLUMNS, "")
        r.update(op="loss", provider=prov, mode="fwd", B="8", K="4", D="128", dtype="fp32",
                 ms=str(ms), commit="c", device="cpu X", date="2026-11-27T00:00:00+00:00",
                 compile_mode=compile_mode, run=run)
        return r
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bench_loss.COLUMNS)
        w.writeheader()
        w.writerows([row("A", "fused", 1.0, "default"), row("A", "compile", 3.0, "default"),
                     row("B", "compile", 2.0, "reduce-overhead")])
    latest = bench_loss.loss_rows(path, "c")
    assert [(r["run"], r["provider"]) for r in latest] == [("B", "compile")]
    first = bench_loss.loss_rows(path, "c", run="A")
    assert sorted(r["provider"] for r in first) == ["compile", "fused"]
    table = bench_loss.summary(path, "c")
    assert table.splitlines()[0] == "torch.compile mode: reduce-overhead."
    assert "| fused |" not in table and "| compile |" in table
    assert "torch.compile mode" not in bench_loss.summary(path, "c", run="A")


def test_an_older_csv_reads_its_compile_mode_as_default(tmp_path):
    """A CSV written before the compile_mode and run columns is rewritten under the new header
    (its rows keep their values); its rows read as the default mode and as one run."""
    path = str(tmp_path / "loss.csv")
    old_columns = bench_loss.COLUMNS[:bench_loss.COLUMNS.index("compile_mode")]
    r = dict.fromkeys(old_columns, "")
    r.update(op="loss", provider="compile", mode="fwd", B="8", K="4", D="128", dtype="fp32",
             ms="3.0", commit="c", device="cpu X", date="2026-11-27T00:00:00+00:00")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_columns)
        w.writeheader()
        w.writerows([r, dict(r, provider="fused", ms="1.0")])
    common.ResultsCsv(path, bench_loss.COLUMNS).close()
    with open(path) as f:
        assert next(csv.reader(f)) == bench_loss.COLUMNS
    rows = bench_loss.loss_rows(path, "c")
    assert sorted(x["provider"] for x in rows) == ["compile", "fused"]
    assert {bench_loss.row_compile_mode(x) for x in rows} == {"default"}


def test_each_invocation_writes_its_run_and_compile_mode_and_shows_only_its_rows(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_loss, "read_gbps", lambda device, nbytes=2 ** 30: 25.0)
    monkeypatch.setattr(common, "read_gbps", lambda device, nbytes=2 ** 30: 25.0)
    argv = ["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N", "40", "--dtype",
            "fp32", "--modes", "fwd", "--no-isolate", "--out", str(tmp_path)]
    path = bench_loss.main(argv + ["--providers", "fused", "eager"])
    bench_loss.main(argv + ["--providers", "fused"])
    out = capsys.readouterr().out
    with open(path) as f:
        rows = list(csv.DictReader(f))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    assert len(runs) == 2 and all(runs)
    assert {r["compile_mode"] for r in rows} == {"default"}
    assert [r["provider"] for r in bench_loss.loss_rows(path, rows[0]["commit"])] == ["fused"]
    second = out[out.rindex("device: "):]  # what the second run printed: its table only
    assert "| fused |" in second and "| eager |" not in second
