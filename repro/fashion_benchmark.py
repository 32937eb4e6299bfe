"""The Fashion-MNIST benchmark: NNGK against tuned competitors, with paired seeds, two class
splits, confidence intervals and a stated detectable difference (protocol: repro/README.md).

    python repro/fashion_benchmark.py power --out OUT [--runs DIR ...]
    python repro/fashion_benchmark.py plan --out OUT
    python repro/fashion_benchmark.py run --stage tune --out OUT [--worker I --workers W]
    python repro/fashion_benchmark.py run --stage test --out OUT [--worker I --workers W]
    python repro/fashion_benchmark.py run --stage extra --out OUT [--worker I --workers W]
    python repro/fashion_benchmark.py report --out OUT

(the command first; ``--data-root`` defaults to Debian's Fashion-MNIST folder).

Stages, each a list of jobs (one ``repro/fashion_mnist.py`` run of one method, seed and split;
resumable: a finished job is skipped, an interrupted one continues from its checkpoint):

* ``tune``: every method gets the same number of validation trials (:data:`SEARCH`) over its
  own documented knobs, per split, on a class-disjoint fold (the split's last two training
  classes held out; the test images are never read), each trial with a per-epoch curve up to
  ``--max-epochs``; a method's knobs and epochs are the (trial, epoch) of best validation
  MAP@R (early stopping).
* ``test``: each method at its chosen knobs and epochs, every seed of ``--seeds`` (a seed gives
  every method the same initial network and batches), on each split; an in-batch NCA control
  (PML's NCALoss at NNGK's chosen sigma: softmax_scale = 1 / (2 sigma^2)); the raw pixels.
  Then the classification curves that pick its epochs (on 10% of the training images).
* ``extra``: embedding sizes (``--dims``) for NNGK and the two competitors best on validation
  (first split); classification with learned per-centre weights against softmax and the
  pixels at ``--per-class`` training images per class (0: the full set).

``report`` writes OUT/report.json and OUT/report.md: every metric as mean and 95% CI over the
seeds, NNGK's paired difference to each competitor with its 95% CI (win: CI above 0, loss:
below, else tie), the difference the design can detect, wall times and the total compute.
``power`` prints the seeds needed for a detectable paired difference of ``--target`` points
from stored runs' paired variances. Jobs are split among ``--workers`` processes by
``--worker`` (one thread each).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from typing import Dict, List, Optional, Sequence

import numpy as np

from nnkloss.experiment.reporting import markdown_table, write_json, write_table
from nnkloss.experiment.seeds import seed_arg
from nnkloss.experiment.setup import HelpFormatter

#: the two class splits: the published one and a random 5/5 split of a fixed seed.
SPLIT_SEED = 56
SPLITS = {"a": [0, 1, 2, 3, 4],
          "b": sorted(int(c) for c in np.random.default_rng(SPLIT_SEED).permutation(10)[:5])}
TUNE_SEED = 1000  # the tuning trials' seed: not one of the test seeds
METRICS = ("recall@1", "map@r", "nmi")

#: the validation trials of each method: the same number for every method, over its own
#: documented knobs (PML's names; nngk: sigma and K; softmax and proxies: learning rates).
#: The first of each is its default (NNGK's published sigma and K), so that a pilot's
#: ``--trials 1`` runs the defaults.
SEARCH: Dict[str, List[dict]] = {
    "nngk": [{"sigma": 0.2, "k": 1000}] + [
        {"sigma": s, "k": k} for s in (0.1, 0.2, 0.3, 0.5) for k in (200, 1000)
        if (s, k) != (0.2, 1000)],
    "nca": [{"softmax_scale": s} for s in (1, 0.5, 2, 4, 8, 16, 32, 64)],
    "contrastive": [{"pos_margin": 0.0, "neg_margin": 1.0}] + [
        {"pos_margin": p, "neg_margin": n} for p in (0.0, 0.2) for n in (0.6, 0.8, 1.0, 1.2)
        if (p, n) != (0.0, 1.0)],
    "multisimilarity": [{"alpha": 2, "beta": 50, "base": 0.5}] + [
        {"alpha": a, "beta": b, "base": c} for a in (1, 2) for b in (20, 50)
        for c in (0.5, 0.8) if (a, b, c) != (2, 50, 0.5)],
    "proxyanchor": [{"margin": 0.1, "alpha": 32, "loss_lr": 1e-2}] + [
        {"margin": m, "alpha": a, "loss_lr": lr} for m in (0.1, 0.2) for a in (16, 32)
        for lr in (1e-2, 1e-1) if (m, a, lr) != (0.1, 32, 1e-2)],
    "normsoftmax": [{"temperature": t} for t in (0.05, 0.01, 0.02, 0.1, 0.2, 0.5, 1.0, 2.0)],
    "arcface": [{"margin": 28.6, "scale": 64}] + [
        {"margin": m, "scale": s} for m in (10.0, 20.0, 28.6, 40.0) for s in (16, 64)
        if (m, s) != (28.6, 64)],
    "softmax": [{"lr": lr} for lr in (1e-3, 1e-4, 2e-4, 5e-4, 2e-3, 5e-3, 1e-2, 2e-2)],
}
CONTROL = "nca-control"


def _fm():
    """repro/fashion_mnist.py as a module (this folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "repro_fashion_mnist", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "fashion_mnist.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def knob_flags(method: str, knobs: dict) -> List[str]:
    """fashion_mnist.py's options for a method at these knobs."""
    knobs = dict(knobs)
    if method == "nngk":
        return ["--nngk-sigma", str(knobs["sigma"]), "--nngk-k", str(knobs["k"])]
    if method == "softmax":
        return ["--lr", str(knobs["lr"])]
    flags = ["--loss-lr", str(knobs.pop("loss_lr"))] if "loss_lr" in knobs else []
    return flags + ["--method-args", json.dumps(knobs, sort_keys=True)]


# ---------------------------------------------------------------------------- jobs
class Job:
    """One fashion_mnist.py invocation: one method, one seed, one output folder."""

    def __init__(self, stage: str, out: str, method: str, seed: int, argv: List[str],
                 name: Optional[str] = None):
        self.stage, self.out, self.method, self.seed = stage, out, method, seed
        self.argv, self.name = argv, name or method

    @property
    def result(self) -> str:
        return os.path.join(self.out, "runs", f"{self.name}-s{self.seed}", "result.json")


def _load_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read(path: str) -> Optional[dict]:
    rec = _load_json(path)
    return rec if isinstance(rec, dict) and isinstance(rec.get("metrics"), dict) else None


def _common(args, per_class: Optional[int] = -1) -> List[str]:
    """Options of every job; ``per_class`` training images per class (-1: --train-per-class,
    None: all)."""
    per_class = args.train_per_class if per_class == -1 else per_class
    out = ["--data-root", args.data_root, "--no-progress", "--threads", "1",
           "--nngk-recalibrate", str(args.recalibrate)] + shlex.split(args.fm_args)
    return out + (["--train-per-class", str(per_class)] if per_class else [])


def tune_jobs(args) -> List[Job]:
    jobs = []
    for split, classes in SPLITS.items():
        out = os.path.join(args.out, "tune", split)
        for method in args.methods:
            for i, knobs in enumerate(SEARCH[method][:args.trials]):
                argv = _common(args) + [
                    "--out", out, "--train-classes", *map(str, classes), "--eval-on", "val",
                    "--curve", "--epochs", str(args.max_epochs), "--methods", method,
                    "--seeds", str(TUNE_SEED), "--tag", f"t{i}", "--nmi-inits", "1"]
                jobs.append(Job("tune", out, method, TUNE_SEED, argv + knob_flags(method, knobs),
                                f"{method}-t{i}"))
    return jobs


def classify_tune_jobs(args) -> List[Job]:
    """The classification epochs' curves (on 10% of the training images), at the knobs that
    split a's retrieval tuning chose."""
    jobs = []
    for per_class in _sizes(args):
        out = os.path.join(args.out, "tune", f"classify-{per_class or 'full'}")
        for method in ("nngk", "softmax"):
            # A scarce set gets the steps of --train-per-class images (more epochs).
            scale = (args.train_per_class or 0) // per_class if per_class else 1
            epochs = args.max_epochs * max(1, scale)
            argv = _classify_argv(args, out, method, per_class) + [
                "--eval-on", "val", "--curve", "--epochs", str(epochs),
                "--seeds", str(TUNE_SEED)] + knob_flags(method, classify_knobs(args, method))
            jobs.append(Job("tune", out, method, TUNE_SEED, argv))
    return jobs


def classify_knobs(args, method: str) -> dict:
    """Split a's retrieval choice; the default where the method is not benchmarked (a pilot
    without softmax)."""
    return choose(args, "a", method)[0] if method in args.methods else SEARCH[method][0]


def _sizes(args) -> List[Optional[int]]:
    return [n or None for n in args.per_class]


def _classify_argv(args, out, method, per_class) -> List[str]:
    argv = _common(args, per_class) + ["--out", out, "--protocol", "classification",
                                       "--methods", method]
    return argv + (["--nngk-learn-weights"] if method == "nngk" else [])


def _trial_rows(args, split: str, method: str):
    """(val MAP@R, val R@1, trial, epoch) of every epoch of every finished trial."""
    out = os.path.join(args.out, "tune", split)
    rows = []
    for i in range(min(args.trials, len(SEARCH[method]))):
        rec = _read(os.path.join(out, "runs", f"{method}-t{i}-s{TUNE_SEED}", "result.json"))
        for row in (rec or {}).get("history", []):
            if row.get("val_map@r") is not None:
                rows.append((row["val_map@r"], row["val_recall@1"], i, row["epoch"]))
    return rows


def _tuned(args, split: str, method: str) -> bool:
    want = set(range(min(args.trials, len(SEARCH[method]))))
    return {r[2] for r in _trial_rows(args, split, method)} == want


def choose(args, split: str, method: str):
    """(knobs, epochs, val MAP@R) of the best validation epoch over the method's trials."""
    if not _tuned(args, split, method):
        raise SystemExit(f"the tuning of {method} on split {split} is not finished: run "
                         f"--stage tune first")
    best = max(_trial_rows(args, split, method))
    return SEARCH[method][best[2]], int(best[3]), float(best[0])


def choose_epochs(args, per_class, method) -> int:
    out = os.path.join(args.out, "tune", f"classify-{per_class or 'full'}")
    rec = _read(os.path.join(out, "runs", f"{method}-s{TUNE_SEED}", "result.json"))
    if rec is None:
        raise SystemExit(f"the classification tuning of {method} at {per_class or 'all'} "
                         f"images per class is not finished: run --stage tune first")
    return int(max((r["val_accuracy"], r["epoch"]) for r in rec["history"])[1])


def best_competitors(args, split: str = "a", n: int = 2) -> List[str]:
    """The n competitors of best validation MAP@R (never the test images)."""
    scores = {m: choose(args, split, m)[2] for m in args.methods if m != "nngk"}
    return sorted(scores, key=scores.get, reverse=True)[:n]


def evaluation_jobs(args) -> List[Job]:
    jobs = []
    for split, classes in SPLITS.items():
        out = os.path.join(args.out, "test", split)
        base = _common(args) + ["--out", out, "--train-classes", *map(str, classes),
                                "--nmi-inits", str(args.nmi_inits)]
        sigma = choose(args, split, "nngk")[0]["sigma"]
        for seed in args.seeds:
            for method in args.methods:
                knobs, epochs, _ = choose(args, split, method)
                jobs.append(Job("test", out, method, seed, base + [
                    "--methods", method, "--seeds", str(seed), "--epochs", str(epochs)]
                    + knob_flags(method, knobs)))
            _, epochs, _ = choose(args, split, "nngk")
            jobs.append(Job("test", out, "nca", seed, base + [
                "--methods", "nca", "--seeds", str(seed), "--epochs", str(epochs), "--tag",
                "control"] + knob_flags("nca", {"softmax_scale": 1 / (2 * sigma ** 2)}),
                CONTROL))
            jobs.append(Job("test", out, "pixels", seed, base + [
                "--methods", "pixels", "--seeds", str(seed)]))
    return jobs + classify_tune_jobs(args)


def extra_jobs(args) -> List[Job]:
    jobs = []
    classes = SPLITS["a"]
    for dim in args.dims:
        out = os.path.join(args.out, "dims", f"a-d{dim}")
        for seed in args.seeds[:args.extra_seeds]:
            for method in ["nngk"] + best_competitors(args):
                knobs, epochs, _ = choose(args, "a", method)
                jobs.append(Job("dims", out, method, seed, _common(args) + [
                    "--out", out, "--train-classes", *map(str, classes), "--dim", str(dim),
                    "--methods", method, "--seeds", str(seed), "--epochs", str(epochs),
                    "--nmi-inits", str(args.nmi_inits)] + knob_flags(method, knobs)))
    for per_class in _sizes(args):
        out = os.path.join(args.out, "classify", f"{per_class or 'full'}")
        for seed in args.seeds[:args.extra_seeds]:
            for method in ("nngk", "softmax", "pixels"):
                argv = _classify_argv(args, out, method, per_class) + ["--seeds", str(seed)]
                if method != "pixels":
                    argv += ["--epochs", str(choose_epochs(args, per_class, method))]
                    argv += knob_flags(method, classify_knobs(args, method))
                jobs.append(Job("classify", out, method, seed, argv))
    return jobs


STAGES = {"tune": tune_jobs, "test": evaluation_jobs, "extra": extra_jobs}


def run_stage(args) -> None:
    fm = _fm()
    jobs = STAGES[args.stage](args)
    mine = [j for i, j in enumerate(jobs) if i % args.workers == args.worker]
    t0, started, done = time.perf_counter(), datetime.now(timezone.utc), 0
    for job in mine:
        # A job is done when its run's result.json is there beside the options that made it
        # (fashion_mnist.py would skip it too, after loading the data).
        argv_path = os.path.join(os.path.dirname(job.result), "job.json")
        if _read(job.result) is not None and _load_json(argv_path) == {"argv": job.argv}:
            continue
        print(f"[{args.stage} {args.worker}/{args.workers}] {job.name} s{job.seed} -> "
              f"{job.out}", flush=True)
        fm.main(job.argv)
        write_json(argv_path, {"argv": job.argv})
        done += 1
    record = {"stage": args.stage, "worker": args.worker, "workers": args.workers,
              "jobs": len(mine), "invoked": done, "start": started.isoformat(timespec="seconds"),
              "wall_s": time.perf_counter() - t0}
    stamp = started.strftime("%Y%m%dT%H%M%S")
    os.makedirs(os.path.join(args.out, "compute"), exist_ok=True)
    write_json(os.path.join(args.out, "compute", f"{stamp}-{args.stage}-{args.worker}.json"),
               record)


# ---------------------------------------------------------------------------- statistics
def t_quantile(n: int) -> float:
    """The 97.5% quantile of Student's t with n - 1 degrees of freedom (inf for n < 2)."""
    if n < 2:
        return math.inf
    from scipy import stats
    return float(stats.t.ppf(0.975, n - 1))


def mean_ci(values: Sequence[float]) -> dict:
    """Mean and 95% CI half-width (t over the values), in points (values are fractions)."""
    a = 100 * np.asarray(values, dtype=np.float64)
    sd = float(a.std(ddof=1)) if len(a) > 1 else math.nan
    return {"n": len(a), "mean": float(a.mean()), "sd": sd,
            "ci": t_quantile(len(a)) * sd / math.sqrt(len(a)) if len(a) > 1 else math.inf}


def verdict(diff: dict) -> str:
    lo, hi = diff["mean"] - diff["ci"], diff["mean"] + diff["ci"]
    return "win" if lo > 0 else "loss" if hi < 0 else "tie"


def seeds_needed(sd: float, target: float, most: int = 200) -> int:
    """The fewest paired units n whose 95% CI half-width t(n-1) sd / sqrt(n) <= target."""
    for n in range(2, most + 1):
        if t_quantile(n) * sd / math.sqrt(n) <= target:
            return n
    return most


def _runs(folder: str) -> Dict[str, Dict[int, dict]]:
    """{name: {seed: record}} of a folder's runs/*/result.json, or of its results.json's
    "runs" where it has no runs/ (the published folders)."""
    out: Dict[str, Dict[int, dict]] = {}
    paths = glob.glob(os.path.join(folder, "runs", "*", "result.json"))
    records = ([_read(p) for p in paths] if paths else
               list(((_load_json(os.path.join(folder, "results.json")) or {}).get("runs")
                     or {}).values()))
    for rec in records:
        if isinstance(rec, dict) and isinstance(rec.get("metrics"), dict):
            out.setdefault(rec.get("name", rec["method"]), {})[rec["seed"]] = rec
    return out


def paired(runs, a: str, b: str, key: str):
    seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
    return [runs[a][s]["metrics"][key] - runs[b][s]["metrics"][key] for s in seeds
            if runs[a][s]["metrics"].get(key) is not None
            and runs[b][s]["metrics"].get(key) is not None]


def compare(runs, keys, reference: str = "nngk") -> dict:
    """Per method and metric mean/CI; the reference's paired differences, verdicts, and the
    mean wall time (and its ratio to the fastest trained competitor's)."""
    table = {m: {k: mean_ci([r["metrics"][k] for r in rs.values()]) for k in keys}
             for m, rs in runs.items()}
    for m, rs in runs.items():
        walls = [r.get("wall_s") for r in rs.values()]
        table[m]["wall_s"] = float(np.mean(walls)) if all(w is not None for w in walls) else None
    diffs = {}
    for m in runs:
        if m == reference:
            continue
        diffs[m] = {}
        for k in keys:
            d = mean_ci(paired(runs, reference, m, k))
            d["verdict"] = verdict(d) if d["n"] > 1 else "n/a"
            diffs[m][k] = d
    trained = [m for m in runs if m not in (reference, "pixels", CONTROL) and table[m]["wall_s"]]
    fastest = min(trained, key=lambda m: table[m]["wall_s"]) if trained else None
    ratio = (table[reference]["wall_s"] / table[fastest]["wall_s"]
             if fastest and reference in table and table[reference]["wall_s"] else None)
    return {"methods": table, "nngk_minus": diffs, "fastest_competitor": fastest,
            "wall_ratio_to_fastest": ratio}


def _pool(entries: List[dict]) -> dict:
    """The splits' estimates combined, each split a stratum: the mean of their means, its
    standard error sqrt(sum sd^2 / n) / J, Student t with sum(n - 1) degrees of freedom (the
    splits' fixed difference is not noise)."""
    if any(e["n"] < 2 for e in entries):
        return {"n": sum(e["n"] for e in entries), "mean": math.nan, "sd": math.nan,
                "ci": math.inf}
    se = math.sqrt(sum(e["sd"] ** 2 / e["n"] for e in entries)) / len(entries)
    df = sum(e["n"] - 1 for e in entries)
    from scipy import stats
    return {"n": sum(e["n"] for e in entries), "mean": float(np.mean([e["mean"] for e in
                                                                       entries])),
            "sd": se * math.sqrt(sum(e["n"] for e in entries)),
            "ci": float(stats.t.ppf(0.975, df)) * se}


def pool_splits(comps: List[dict]) -> dict:
    """:func:`compare`'s result over several splits, each a stratum (:func:`_pool`)."""
    methods = [m for m in comps[0]["methods"] if all(m in c["methods"] for c in comps)]
    out = {"methods": {}, "nngk_minus": {}}
    for m in methods:
        out["methods"][m] = {k: _pool([c["methods"][m][k] for c in comps]) for k in METRICS}
        walls = [c["methods"][m]["wall_s"] for c in comps]
        out["methods"][m]["wall_s"] = None if None in walls else float(np.mean(walls))
        if m != "nngk":
            out["nngk_minus"][m] = {k: _pool([c["nngk_minus"][m][k] for c in comps])
                                    for k in METRICS}
            for d in out["nngk_minus"][m].values():
                d["verdict"] = verdict(d)
    ratios = [c["wall_ratio_to_fastest"] for c in comps]
    out["fastest_competitor"] = comps[0]["fastest_competitor"]
    out["wall_ratio_to_fastest"] = None if None in ratios else float(np.mean(ratios))
    return out


def power(args) -> dict:
    """Paired sd of NNGK's difference to each competitor in stored runs, and the seeds needed
    for a 95% CI half-width of --target points."""
    out = {}
    for folder in args.runs:
        runs = _runs(folder)
        for m in runs:
            if m.startswith("nngk") or m == "pixels" or "nngk" not in runs:
                continue
            for k in ("recall@1", "map@r"):
                d = mean_ci(paired(runs, "nngk", m, k))
                if d["n"] > 1:
                    out.setdefault(folder, {}).setdefault(m, {})[k] = {
                        "sd": d["sd"], "n": d["n"], "detectable_now": d["ci"],
                        "seeds_needed": seeds_needed(d["sd"], args.target)}
    print(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------- report
def _fmt(d: dict) -> str:
    return "-" if d is None or d["n"] == 0 else f"{d['mean']:.2f} ± {d['ci']:.2f}"


def report(args) -> dict:
    res: dict = {"splits": SPLITS, "seeds": list(args.seeds), "retrieval": {}, "dims": {},
                 "classification": {}, "choices": {}}
    md = []
    for split in SPLITS:
        runs = _runs(os.path.join(args.out, "test", split))
        if runs:
            res["retrieval"][split] = comp = compare(runs, METRICS)
            md.append(_table(comp, METRICS, f"Retrieval, split {split} (train classes "
                                            f"{SPLITS[split]}), test, mean ± 95% CI"))
        res["choices"][split] = {m: dict(zip(("knobs", "epochs", "val_map@r"),
                                             choose(args, split, m)))
                                 for m in args.methods if _tuned(args, split, m)}
    if len(res["retrieval"]) > 1:
        res["retrieval"]["pooled"] = comp = pool_splits(list(res["retrieval"].values()))
        md.append(_table(comp, METRICS, "Retrieval, both splits (the mean of the splits' "
                                        "means, split as a stratum), mean ± 95% CI"))
    for folder in sorted(glob.glob(os.path.join(args.out, "dims", "*"))):
        res["dims"][os.path.basename(folder)] = comp = compare(_runs(folder), METRICS)
        md.append(_table(comp, METRICS, f"Embedding size, {os.path.basename(folder)}"))
    for folder in sorted(glob.glob(os.path.join(args.out, "classify", "*"))):
        res["classification"][os.path.basename(folder)] = comp = compare(_runs(folder),
                                                                         ("accuracy",))
        md.append(_table(comp, ("accuracy",), f"Classification, {os.path.basename(folder)} "
                                              f"training images per class, test accuracy"))
    walls = [_read(p) or {} for p in glob.glob(os.path.join(args.out, "*", "*", "runs", "*",
                                                             "result.json"))]
    res["compute"] = {"runs": len(walls),
                      "run_wall_s": float(sum(r.get("wall_s") or 0.0 for r in walls)),
                      "invocations_wall_s": float(sum(
                          (_load_json(p) or {}).get("wall_s", 0.0)
                          for p in glob.glob(os.path.join(args.out, "compute", "*.json"))))}
    md.append(f"Compute: {res['compute']['runs']} runs, {res['compute']['run_wall_s']:.0f} s "
              f"of run wall time; {res['compute']['invocations_wall_s']:.0f} s over the "
              f"recorded invocations (tuning included).\n")
    write_json(os.path.join(args.out, "report.json"), json.loads(json.dumps(res, default=float)))
    write_table(os.path.join(args.out, "report.md"), "\n".join(md))
    return res


def _table(comp: dict, keys, title: str) -> str:
    heads = {"recall@1": "R@1", "map@r": "MAP@R", "nmi": "NMI", "accuracy": "accuracy"}
    rows = []
    for m, t in comp["methods"].items():
        diff = comp["nngk_minus"].get(m, {})
        rows.append([m, str(t[keys[0]]["n"])] + [_fmt(t[k]) for k in keys]
                    + [f"{_fmt(diff[k])} {diff[k]['verdict']}" if k in diff else "-"
                       for k in keys]
                    + ["-" if t["wall_s"] is None else f"{t['wall_s']:.0f}"])
    ratio = comp["wall_ratio_to_fastest"]
    note = ("" if ratio is None else f" NNGK's wall time is {ratio:.2f}x the fastest "
            f"competitor's ({comp['fastest_competitor']}).")
    trained = [m for m in comp["nngk_minus"] if m not in ("pixels", CONTROL)]
    if trained:  # the half-width the design reached: the difference it can detect
        note += " Detectable difference reached (largest 95% CI half-width over the " \
                "competitors): " + ", ".join(
                    f"{heads[k]} {max(comp['nngk_minus'][m][k]['ci'] for m in trained):.2f}"
                    for k in keys) + "."
    return markdown_table(["method", "seeds"] + [heads[k] for k in keys]
                          + [f"NNGK - it, {heads[k]}" for k in keys] + ["wall s"], rows,
                          title=title) + note + "\n"


def plan(args) -> None:
    """The jobs of each stage that can be listed now (later stages need the tuning)."""
    for stage, fn in STAGES.items():
        try:
            jobs = fn(args)
        except SystemExit as exc:
            print(f"{stage}: not yet listable ({exc})")
            continue
        done = sum(_read(j.result) is not None for j in jobs)
        print(f"{stage}: {len(jobs)} jobs, {done} finished")


# ---------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--data-root", default="/usr/share/datasets/fashion-mnist",
                   help="folder with the four Fashion-MNIST IDX files")
    p.add_argument("--out", required=True, help="the benchmark's folder (resumable)")
    p.add_argument("--seeds", type=seed_arg, nargs="+", default=list(range(12)),
                   help="test seeds, paired across methods (the power analysis: repro/README.md)")
    p.add_argument("--extra-seeds", type=int, default=5,
                   help="the extra stage (sizes, classification) runs the first this many seeds")
    p.add_argument("--train-per-class", type=int, default=2000,
                   help="training images per class (0: all)")
    p.add_argument("--max-epochs", type=int, default=8,
                   help="epochs of each validation curve (early stopping picks within them)")
    p.add_argument("--dims", type=int, nargs="+", default=[128, 512],
                   help="embedding sizes besides 64 (NNGK and the two best competitors)")
    p.add_argument("--per-class", type=int, nargs="+", default=[100, 500, 0],
                   help="classification: training images per class (0: the full set)")
    p.add_argument("--nmi-inits", type=int, default=10)
    p.add_argument("--recalibrate", default="10",
                   help="NNGK's BatchNorm recalibration: 'all', 'off' or a number of batches")
    p.add_argument("--target", type=float, default=1.5, help="power: detectable points")
    p.add_argument("--runs", nargs="+", default=["repro/results/fashion_mnist/retrieval"],
                   help="power: folders of stored runs")
    p.add_argument("--methods", nargs="+", default=list(SEARCH), choices=list(SEARCH),
                   help="the methods (nngk first; a subset for a pilot)")
    p.add_argument("--trials", type=int, default=8,
                   help="validation trials per method: the first this many of its search")
    p.add_argument("--fm-args", default="",
                   help="further options of every fashion_mnist.py run (e.g. a smaller network "
                        "for a smoke test)")
    p.add_argument("--stage", choices=sorted(STAGES), default="tune")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("command", choices=("power", "plan", "run", "report"))
    args = p.parse_args(argv)
    for flag in ("max_epochs", "trials", "extra_seeds", "workers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "nngk" not in args.methods or len(args.methods) < 3:
        p.error("--methods must hold nngk and at least two competitors")
    args.methods = ["nngk"] + [m for m in args.methods if m != "nngk"]
    if not 0 <= args.worker < args.workers:
        p.error(f"--worker must be in 0..{args.workers - 1}, got {args.worker}")
    return args


def main(argv: Optional[Sequence[str]] = None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return {"power": power, "plan": plan, "run": run_stage, "report": report}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
