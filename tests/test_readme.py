"""The README's examples run as written (on CPU, with tiny data), and its figures are those of
the results files they cite."""
# Cross-cutting suite (tests/test_layout.py CROSS_CUTTING): the README's examples as written.
import os
import re

import torch


README = os.path.join(os.path.dirname(__file__), "..", "README.md")


ROOT = os.path.join(os.path.dirname(__file__), "..")


def readme_blocks(heading):
    text = open(README, encoding="utf-8").read()
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def readme_table(caption):
    """The rows of the markdown table that follows ``caption`` in the README, as dicts."""
    text = open(README, encoding="utf-8").read()
    lines = text[text.index(caption):].splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = []
    for ln in lines[first:]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip("|").split("|")])
    header, body = table[0], table[2:]
    return [dict(zip(header, r)) for r in body]


def test_readme_cpu_example_runs_as_printed(capsys):
    (code,) = readme_blocks("## A first run on the CPU")[:1]
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert torch.isfinite(ns["loss"])
    assert ns["accuracy"] > 0.8  # six separable classes: the kernel classifier learns them
    assert ns["bank"].has_neighbours and ns["bank"].k == 50
    assert "test accuracy" in capsys.readouterr().out


def test_readme_index_wrapper_yields_the_index():
    code = readme_blocks("## A first run on the CPU")[1]
    ns = {"torch": torch}
    exec(compile(code, "README.md", "exec"), ns)
    base = [(torch.tensor([float(i)]), i % 3) for i in range(5)]
    x, y, i = ns["Indexed"](base)[4]
    assert (float(x), y, i) == (4.0, 1, 4) and len(ns["Indexed"](base)) == 5


LOSS_FILES = {"NVIDIA H200": "loss_NVIDIA_H200.csv",
              "NVIDIA H100": "loss_NVIDIA_H100_80GB_HBM3.csv",
              "2-core AMD EPYC family 26": "loss_AMD_EPYC_family_26_model_2.csv"}


def results_rows(name):
    import csv
    with open(os.path.join(ROOT, "benchmarks", "results", name), newline="") as f:
        return list(csv.DictReader(f))


def test_readme_speed_figures_are_those_of_the_results_files():
    rows = (readme_table("**GPU** (B 4096, K 100, forward+backward")
            + readme_table("**CPU** (2 threads, forward+backward"))
    assert len(rows) == 9
    for r in rows:
        if "B, K, D, bank" in r:
            b, k, d, dtype = (v.strip() for v in r["B, K, D, bank"].split(","))
        else:  # the GPU table's caption gives B 4096, K 100
            b, k = "4096", "100"
            d, dtype = (v.strip() for v in r["D, bank"].split(","))
        commit = r["commit"].strip("`")
        found = {}
        for row in results_rows(LOSS_FILES[r["device"]]):
            if (row["commit"] == commit and row["op"] == "loss" and row["mode"] == "fwd_bwd"
                    and (row["B"], row["K"], row["D"], row["dtype"]) == (b, k, d, dtype)
                    and (row.get("grads") or "emb") == "emb"
                    and row.get("step", "bench_loss") == "bench_loss"):
                found.setdefault(row["provider"], row)
        fused, comp = found["fused"], found["compile"]
        assert float(r["fused ms"]) == float(fused["ms"]), r
        assert float(r["torch.compile ms"]) == float(comp["ms"]), r
        assert r["x compile"] == f"{float(comp['ms']) / float(fused['ms']):.2f}x", r
        assert r["date"] == fused["date"][:10]
        if "timer" in r:
            assert r["timer"] == (fused.get("timer") or "do_bench"), r
            mem = [float(fused["peak_mem_mb"]), float(comp["peak_mem_mb"])]
        else:  # the CPU's cold figure is the forward's (the modes share a process)
            fwd = {row["provider"]: row for row in results_rows(LOSS_FILES[r["device"]])
                   if row["commit"] == commit and row["mode"] == "fwd"
                   and (row["B"], row["K"], row["D"], row["dtype"]) == (b, k, d, dtype)}
            mem = [float(fwd["fused"]["peak_mem_mb"]), float(fwd["compile"]["peak_mem_mb"])]
        mb = [c for c in r if c.startswith("MB fused / compile")][0]
        assert [float(v) for v in r[mb].split("/")] == mem, r


def test_readme_real_data_figures_are_those_of_the_benchmark_report():
    """The real-data table is the Fashion-MNIST benchmark's pooled report: NNGK, the best
    competitor on each metric, the paired differences with their verdicts, the control and
    the pixels."""
    import json
    path = os.path.join(ROOT, "repro", "results", "fashion_mnist", "benchmark", "report.json")
    with open(path, encoding="utf-8") as f:
        pooled = json.load(f)["retrieval"]["pooled"]
    methods, diffs = pooled["methods"], pooled["nngk_minus"]

    def ci(d):
        return f"{d['mean']:.2f} +- {d['ci']:.2f}"
    rows = readme_table("**Real data** (Fashion-MNIST")
    assert [r["metric"] for r in rows] == ["R@1 %", "MAP@R %"]
    for r, key in zip(rows, ("recall@1", "map@r")):
        assert r["NNGK"] == ci(methods["nngk"][key]), r
        rivals = [m for m in methods if m not in ("nngk", "nca-control", "pixels")]
        best = max(rivals, key=lambda m: methods[m][key]["mean"])
        assert r["best tuned competitor"] == f"{best} {ci(methods[best][key])}", r
        assert r["NNGK - best"] == f"{ci(diffs[best][key])} {diffs[best][key]['verdict']}", r
        assert r["in-batch NCA control"] == ci(methods["nca-control"][key]), r
        control = diffs["nca-control"][key]
        assert r["NNGK - control"] == f"{ci(control)} {control['verdict']}", r
        assert r["raw pixels"] == f"{methods['pixels'][key]['mean']:.2f}", r
    rows = readme_table("**Classification with learned per-centre weights**")
    with open(path, encoding="utf-8") as f:
        classification = json.load(f)["classification"]
    assert [r["training images per class"] for r in rows] == ["100", "500", "full"]
    for r in rows:
        c = classification[r["training images per class"]]
        acc = {m: v["accuracy"] for m, v in c["methods"].items()}
        assert r["NNGK accuracy %"] == ci(acc["nngk"]), r
        assert r["softmax accuracy %"] == ci(acc["softmax"]), r
        diff = c["nngk_minus"]["softmax"]["accuracy"]
        assert r["NNGK - softmax"] == f"{ci(diff)} {diff['verdict']}", r
        assert r["1-NN on pixels %"] == f"{acc['pixels']['mean']:.2f}", r
