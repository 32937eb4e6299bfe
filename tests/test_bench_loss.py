"""benchmarks/bench_loss.py: its providers compute the loss, a CPU run writes the table
(in process and with every measurement in a fresh process), and the CUDA branch of a row (the
wall time, the kernels alone, the backward's graph) is reached with CUDA stood in; and the
other CPU benchmarks that share its helpers (bench_refresh, profile_step)."""
import argparse
import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_loss  # noqa: E402
import common  # noqa: E402

import nnkloss  # noqa: E402

SMALL = ["--device", "cpu", "--B", "4", "--K", "3", "--D", "5", "--N", "40", "--read-mb", "1"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


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


def test_cpu_smoke_run_writes_the_table_and_plot(tmp_path, monkeypatch):
    """One CSV of common.TABLE_COLUMNS: a row per provider, pass and shape; the read share is
    the gathered rows over the wall time against the read of the process that timed them (the
    run's own read told apart by its size), none for the backward; no kernel time off CUDA."""
    fake = lambda device, nbytes=2 ** 30: 40.0 if nbytes == 2 ** 20 else 25.0  # noqa: E731
    monkeypatch.setattr(bench_loss, "read_gbps", fake)
    path = bench_loss.main(SMALL + ["--dtype", "fp32", "bf16", "--providers", "fused", "eager",
                                    "--no-isolate", "--out", str(tmp_path)])
    assert nnkloss.validation.value_checks_enabled(), "the benchmark leaves the setting as it was"
    assert os.path.basename(path).startswith("loss_") and not os.path.exists(path + ".partial")
    rows = _rows(path)
    assert list(rows[0]) == common.TABLE_COLUMNS
    assert len(rows) == 2 * 3 * 2  # dtypes x passes x providers
    assert {r["pass"] for r in rows} == {"forward", "backward", "both"}
    for r in rows:
        assert float(r["wall_ms"]) > 0 and float(r["peak_mb"]) >= 0 and r["kernel_ms"] == ""
        assert r["shape"] == "B=4 K=3 D=5 N=40" and r["operation"] == "loss" and r["date"]
        assert r["command"].startswith("python3 benchmarks/bench_loss.py --device cpu --B 4 ")
        if r["pass"] == "backward":
            assert r["pct_read_wall"] == r["read_gb"] == ""
            continue
        esize = 4 if r["dtype"] == "fp32" else 2
        gbps = 4 * 3 * 5 * esize / float(r["wall_ms"]) / 1e6
        assert float(r["read_gbps"]) == 40.0
        assert float(r["pct_read_wall"]) == pytest.approx(100 * gbps / 40.0, rel=1e-2, abs=0.06)
    assert os.path.getsize(path[:-4] + ".png") > 1000


def test_name_and_also_grad_reach_the_file_and_the_rows(tmp_path, monkeypatch):
    """--name names the CSV (two benchmarks of one run side by side); --also-grad gives a
    gradient to sigma and the centres too in the backward passes, and the rows say so."""
    seen = []
    real = bench_loss.fused_loss

    def spy(emb, labels, centres, cl, nb, w, sigma):
        seen.append((emb.requires_grad, sigma.requires_grad, w.requires_grad,
                     centres.requires_grad))
        return real(emb, labels, centres, cl, nb, w, sigma)
    monkeypatch.setattr(bench_loss, "fused_loss", spy)
    path = bench_loss.main(SMALL + ["--dtype", "fp32", "--providers", "fused", "--no-isolate",
                                    "--also-grad", "sigma", "centres", "--name", "grads",
                                    "--out", str(tmp_path)])
    assert os.path.basename(path).startswith("grads_")
    assert set(seen) == {(False, False, False, False), (True, True, False, True)}
    assert [r["note"] for r in _rows(path)] == ["", "emb+sigma+centres", "emb+sigma+centres"]
    with pytest.raises(ValueError, match="module provider trains the embeddings only"):
        bench_loss.run_one("module", "bwd", bench_loss.make_inputs(4, 3, 5, 40, torch.float32,
                                                                   torch.device("cpu")),
                           torch.device("cpu"), 1, ["sigma"])


def test_isolated_run_measures_time_and_peak_memory(tmp_path):
    path = bench_loss.main(["--device", "cpu", "--B", "16", "--K", "8", "--D", "32", "--N",
                            "100", "--dtype", "bf16", "--providers", "fused", "torch",
                            "--modes", "fwd_bwd", "--read-mb", "1", "--out", str(tmp_path)])
    rows = _rows(path)
    assert [r["provider"] for r in rows] == ["fused", "torch"]
    for r in rows:
        assert float(r["wall_ms"]) > 0 and float(r["peak_mb"]) >= 0 and not r["note"]
        assert r["commit"] and r["device"] and float(r["read_gbps"]) > 0


def test_repeats_interleave_providers_and_keep_the_median_round(tmp_path, monkeypatch):
    order, times = [], iter([3.0, 5.0, 1.0, 6.0, 2.0, 4.0])

    def fake(prov, mode, *a):
        order.append(prov)
        return {"wall_ms": next(times), "kernel_ms": None, "peak_mb": len(order),
                "first_ms": 1.0, "note": ""}
    monkeypatch.setattr(bench_loss, "run_one", fake)
    path = bench_loss.main(SMALL + ["--dtype", "fp32", "--providers", "fused", "eager",
                                    "--modes", "fwd", "--repeats", "3", "--no-isolate",
                                    "--out", str(tmp_path)])
    assert order == ["fused", "eager"] * 3
    fused, eager = _rows(path)
    assert fused["wall_ms"] == "2" and fused["peak_mb"] == "5.0"  # median time, largest peak
    assert fused["note"] == "rounds 3 1 2" and eager["wall_ms"] == "5"


def test_a_failed_measurement_is_a_row_that_says_why(tmp_path, monkeypatch):
    def oom(*a):
        raise torch.OutOfMemoryError("no room")
    monkeypatch.setattr(bench_loss, "run_one", oom)
    path = bench_loss.main(SMALL + ["--dtype", "fp32", "--providers", "fused", "--modes", "fwd",
                                    "--no-isolate", "--out", str(tmp_path)])
    (row,) = _rows(path)
    assert row["note"] == "out of memory" and row["wall_ms"] == ""


def _stand_in_cuda(monkeypatch, graph):
    """run_one's CUDA branch on CPU tensors: synchronisation and memory stood in, wall_ms a
    constant, graph_ms the given function."""
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(bench_loss, "wall_ms", lambda fn, device, reps: 1.0)
    monkeypatch.setattr(bench_loss, "graph_ms", graph)


def test_on_cuda_each_pass_times_its_kernels_in_a_graph(monkeypatch):
    """forward and both: the step's graph; backward: both's graph minus a training forward's
    (each told apart here by whether its call runs a backward); a call that cannot be
    captured keeps its wall time and says why."""
    inputs = bench_loss.make_inputs(8, 4, 16, 100, torch.float32, torch.device("cpu"))

    real_backward = torch.Tensor.backward

    def graph(fn, device, reps, calls):
        backwards = []
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.Tensor, "backward",
                      lambda self, *a, **k: backwards.append(1) or real_backward(self, *a, **k))
            fn()
        return 5.0 if backwards else 2.0
    _stand_in_cuda(monkeypatch, graph)
    with nnkloss.value_checks(False):
        got = {mode: bench_loss.run_one("fused", mode, inputs, torch.device("cuda"), reps=1)
               for mode in ("fwd", "bwd", "fwd_bwd")}
    assert {m: r["kernel_ms"] for m, r in got.items()} == {"fwd": 2.0, "bwd": 3.0,
                                                         "fwd_bwd": 5.0}
    assert got["fwd"]["wall_ms"] == 1.0 and got["bwd"]["wall_ms"] > 0

    def refuses(fn, device, reps, calls):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(bench_loss, "graph_ms", refuses)
    with nnkloss.value_checks(False):
        r = bench_loss.run_one("module_unchecked", "fwd_bwd", inputs, torch.device("cuda"), reps=1)
    assert r["kernel_ms"] is None and r["wall_ms"] == 1.0
    assert r["note"] == "no CUDA graph: operation not permitted when stream is capturing"


def test_cpu_default_grid_is_the_issue_shapes():
    none = argparse.Namespace(B=None, K=None, D=None, N=None, dtype=None)
    assert bench_loss.shapes(none, torch.device("cpu")) == bench_loss.CPU_GRID
    assert len(bench_loss.shapes(none, torch.device("cuda"))) == 2 * 27
    some = argparse.Namespace(B=[4], K=[3], D=[5], N=40, dtype=None)
    assert bench_loss.shapes(some, torch.device("cpu")) == [(4, 3, 5, 40, "fp32"),
                                                            (4, 3, 5, 40, "bf16")]


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
    assert out.count("== fwd") == 2 and "nnkloss/ops/" in out and "commit" in out


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
    lists = "batch_lists" if nnkloss.cpu.available() else "neighbours_for"
    assert lists in module_part and lists not in out.split("== module")[0]


def test_profile_step_times_the_module_with_the_lists_by_torch(capsys, monkeypatch):
    """module_torch_lists: the module's call with the one-launch lists kernel turned off for
    that provider only (here the kernel route is stood in on CPU tensors: its calls counted)."""
    import profile_step
    from nnkloss.losses import base
    calls = []

    def stand_in(device, choice="auto"):
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




def test_the_compile_provider_compiles_the_eager_loss_once_a_process():
    """compile: torch.compile of the user's loss, built once and shared by the passes; its
    loss and gradient are eager's."""
    inputs = bench_loss.make_inputs(8, 4, 16, 100, torch.float32, torch.device("cpu"))
    bench_loss._COMPILED.clear()
    fn = bench_loss.provider_fn("compile", inputs)
    assert bench_loss.provider_fn("compile", inputs) is fn
    results = []
    for f in (bench_loss.eager_loss, fn):
        x = inputs[0].clone().requires_grad_(True)
        loss = f(x, *inputs[1:])
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    r = bench_loss.run_one("compile", "fwd_bwd", inputs, torch.device("cpu"), reps=1)
    assert r["wall_ms"] > 0 and r["kernel_ms"] is None


@pytest.mark.cuda
def test_the_op_and_the_module_are_captured_whole_in_a_cuda_graph():
    """On a GPU every pass of the op's and the module's (checks off) call is captured in one
    CUDA graph: a host synchronisation or a host-side tensor on that path would leave the
    row's kernel time empty and its note saying why."""
    device = torch.device("cuda")
    inputs = bench_loss.make_inputs(64, 8, 32, 1000, torch.float32, device)
    with nnkloss.value_checks(False):
        for prov in ("fused", "module_unchecked", "eager"):
            for mode in ("fwd", "bwd", "fwd_bwd"):
                r = bench_loss.run_one(prov, mode, inputs, device, reps=5)
                assert r["note"] == "" and r["kernel_ms"] is not None, (prov, mode, r)
                assert r["wall_ms"] > 0
