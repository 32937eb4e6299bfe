"""Threads on a shared machine (issue 21): the digits demo, the CPU op and the retrieval
evaluation at 1 thread, at 2 threads and at the default (2 threads, governed), with the machine
as it is ("idle") and beside a competing 2-thread process (a torch matmul loop), measured
interleaved (1, 2, default, 1, 2, default, ...).

    python benchmarks/bench_threads.py                        # demo at 5 epochs, op, 1 round
    python benchmarks/bench_threads.py --epochs 30 --rounds 2 # the README's demo (long)
    python benchmarks/bench_threads.py --parts op --loads matmul2
    python benchmarks/bench_threads.py --parts eval --rounds 3
    python benchmarks/bench_threads.py --parts op --loads matmul2 --settings 1 default \
        --interleave-op --rounds 3              # the settings side by side in one process

Settings: ``1`` and ``2`` (or any count N >= 1) are fixed counts (``repro/digits.py --threads N``;
for the op ``torch.set_num_threads(N)`` and ``NNKLOSS_GOVERN_THREADS=0``), ``default`` is what a user gets
without asking (the demo's ``--threads auto``: the Trainer's ThreadGovernor; the op at torch's
default count with its per-entry governors). Every demo run and every op measurement is a fresh
process. The op: median ms of 40 calls after 3 warm-ups of ``nnkloss.neighbour_kernel_loss``,
forward-only (``fwd``) and forward+backward to the embeddings (``fwd_bwd``), at the CPU shapes
of bench_loss.py (N bank rows as there). Beside a busy process one call's time spreads widely
(its 90th percentile about twice its median on the 2-core machine) and the competitor's demand
moves over seconds, so 40 calls in a process of their own can meet another moment of the load
than the setting they are compared with: ``--interleave-op`` runs the settings in one process
instead, taking turns of ``--op-block`` calls until each has ``--op-iters`` (default 120) per
shape and mode. The evaluation (``eval``): the seconds of one ``nnkloss.metrics.evaluate``
(Recall@1/2/4/8, MAP@R) of ``--eval-n`` points of bench_eval.py's data (30,000: its symmetric
search, about a second at two threads), in a fresh process per setting: the search's GEMM and
selection governed like the op, torch's own ops of each block at the governed count.

Appends to ``benchmarks/results/threads_<device>.txt`` one line per measurement, each with the
device, commit, UTC date and load average (``os.getloadavg``: 1, 5, 15 minutes) at its start
(and, for the default, the governors' choices and how many of their decisions the run queue
signal made: ``by_signal/decisions``), then a summary of the ratios to the 1-thread figure of
the same load and round.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import (device_name, git_commit, load_average, results_path, time_ms,  # noqa: E402
                    utc_now)

import torch  # noqa: E402

SETTINGS = ["1", "2", "default"]
LOADS = ["idle", "matmul2"]
# (B, K, D, N, bank dtype): bench_loss.CPU_GRID
OP_SHAPES = [(256, 100, 512, 20000, "fp32"), (1024, 32, 128, 50000, "fp32"),
             (64, 256, 2048, 10000, "fp32"), (256, 100, 512, 20000, "bf16")]
COMPETITOR = ("import torch\n"
              "torch.set_num_threads(2)\n"
              "a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)\n"
              "while True:\n"
              "    a @ b\n")


def setting_arg(text: str) -> str:
    """``--settings`` item: "default" or a fixed thread count >= 1 (as its decimal string)."""
    if text == "default":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a setting is 'default' or a thread count >= 1, "
                                         f"got {text!r}")
    return str(n)


def _env(setting):
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if setting != "default":
        env["NNKLOSS_GOVERN_THREADS"] = "0"
    else:
        env.pop("NNKLOSS_GOVERN_THREADS", None)
    return env


def run_demo(setting, epochs):
    """Wall seconds of ``repro/digits.py --epochs epochs`` at the setting (a fresh process)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "repro", "digits.py"), "--out", out,
               "--epochs", str(epochs), "--no-progress",
               "--threads", "auto" if setting == "default" else setting]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=_env(setting), capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"digits.py failed: {proc.stderr[-2000:]}")
        decisions, by_signal = _demo_threads(out)
    return wall, decisions, by_signal


def _demo_threads(out):
    """The governor's choice at each epoch's end per run (log.json threads column), and how
    many of its decisions the run queue signal made (threads_by_signal), if logged."""
    found, by_signal = {}, {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, "log.json")
        if os.path.isfile(path):
            with open(path) as f:
                rows = json.load(f)
            rows = rows.get("epochs", rows) if isinstance(rows, dict) else rows
            if rows and isinstance(rows, list) and "threads" in rows[-1]:
                found[name] = [r.get("threads") for r in rows]
                if "threads_by_signal" in rows[-1]:
                    by_signal[name] = (rows[-1]["threads_by_signal"],
                                       rows[-1].get("threads_decisions"))
    return found, by_signal


def _op_steps():
    """(key, step) for every shape of OP_SHAPES and mode (fwd, fwd_bwd): one call of the op
    as users make it, value checks off."""
    from bench_loss import DTYPES, fused_loss, make_inputs
    steps = []
    for B, K, D, N, dt in OP_SHAPES:
        inputs = make_inputs(B, K, D, N, DTYPES[dt], torch.device("cpu"))
        for mode in ("fwd", "fwd_bwd"):
            x = inputs[0].detach().clone().requires_grad_(mode == "fwd_bwd")

            def step(x=x, inputs=inputs, mode=mode):
                loss = fused_loss(x, *inputs[1:])
                if mode == "fwd_bwd":
                    x.grad = None
                    loss.backward()
            steps.append((f"{mode} {B},{K},{D},{dt}", step))
    return steps


def _governor_report(cpu):
    return {"_governors": {k: g.summary()["threads"] for k, g in cpu._governors.items()},
            "_by_signal": {k: [g.summary()["by_signal"], len(g.events)]
                           for k, g in cpu._governors.items()},
            "_pool": cpu.build_info().get("pool")}


def eval_worker(setting, n):
    """Wall ms of one evaluate of ``n`` points in this process (after one of 2,000, untimed:
    the library loaded, first-call costs); prints one JSON line."""
    if setting != "default":
        torch.set_num_threads(int(setting))
    from bench_eval import KS, setup
    from nnkloss.evaluation import metrics
    from nnkloss.ops import cpu
    cpu.available()
    emb, labels = setup(n, 128, 100)
    metrics.evaluate(emb[:2000], labels[:2000], KS)
    t0 = time.perf_counter()
    metrics.evaluate(emb, labels, KS)
    res = {f"evaluate N={n}": (time.perf_counter() - t0) * 1e3}
    res.update(_governor_report(cpu))
    print(json.dumps(res))


def op_worker(setting, iters=40):
    """Median ms per (shape, mode) in this process; prints one JSON line."""
    if setting != "default":
        torch.set_num_threads(int(setting))
    import nnkloss
    from nnkloss.ops import cpu
    cpu.available()
    res = {}
    with nnkloss.value_checks(False):
        for key, step in _op_steps():
            res[key] = time_ms(step, "cpu", warmup=3, iters=iters)
    res.update(_governor_report(cpu))
    print(json.dumps(res))


def _apply(setting, full):
    """Make this process run as ``setting``: "1" / "2" a fixed torch count with the op's
    governors off, "default" torch's own count (``full``) with them on (as _env does for a
    fresh process; cpu.governing() reads the variable at every call)."""
    if setting == "default":
        os.environ.pop("NNKLOSS_GOVERN_THREADS", None)
        torch.set_num_threads(full)
    else:
        os.environ["NNKLOSS_GOVERN_THREADS"] = "0"
        torch.set_num_threads(int(setting))


def op_worker_interleaved(settings, iters=120, block=10):
    """Every setting in this one process, in turn, ``block`` calls at a time, until each has
    run ``iters`` timed calls per (shape, mode): each setting sees the same moments of a
    competing load, which moves over seconds (a fresh process per setting met it at other
    moments). Median ms per setting and (shape, mode); prints one JSON line {setting: {...}}.
    The governors keep their state across the blocks of "default", as in a real process (the
    calls of the other settings run with them off and are not recorded)."""
    full = torch.get_num_threads()
    import nnkloss
    from nnkloss.ops import cpu
    cpu.available()
    times = {s: {} for s in settings}
    with nnkloss.value_checks(False):
        for key, step in _op_steps():
            for setting in settings:  # warm-ups, untimed
                _apply(setting, full)
                for _ in range(3):
                    step()
            for _ in range(-(-iters // block)):
                for setting in settings:
                    _apply(setting, full)
                    for _ in range(block):
                        t = time.perf_counter()
                        step()
                        times[setting].setdefault(key, []).append(
                            (time.perf_counter() - t) * 1e3)
    _apply("default", full)
    out = {}
    for setting, per_key in times.items():
        out[setting] = {k: sorted(v)[len(v) // 2] for k, v in per_key.items()}
        out[setting].update(_governor_report(cpu) if setting == "default" else
                            {"_governors": {}, "_by_signal": {},
                             "_pool": cpu.build_info().get("pool")})
    print(json.dumps(out))


def _op_worker_reply(args, setting):
    """The JSON line of this script run as an op worker with ``args``, in a fresh process
    with the environment of ``setting``."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)] + args,
                          env=_env(setting), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"op worker failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_op(setting):
    return _op_worker_reply(["--op-worker", setting], setting)


def run_eval(setting, n):
    return _op_worker_reply(["--eval-worker", setting, "--eval-n", str(n)], setting)


def run_op_interleaved(settings, iters, block):
    return _op_worker_reply(["--op-worker-interleaved", ",".join(settings), "--op-iters",
                             str(iters), "--op-block", str(block)], "default")


class Competitor:
    """A 2-thread torch matmul loop in its own process, for the 'matmul2' load."""

    def __init__(self, kind):
        self.kind, self.proc = kind, None

    def __enter__(self):
        if self.kind == "matmul2":
            self.proc = subprocess.Popen([sys.executable, "-c", COMPETITOR],
                                         env={**os.environ, "OMP_NUM_THREADS": "2"})
            time.sleep(3)  # let it start and allocate
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5, help="demo epochs per run (README: 30)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per load")
    p.add_argument("--settings", nargs="+", default=SETTINGS, type=setting_arg,
                   help="'default' or a fixed thread count (1, 2, ...; e.g. the machine's CPU "
                        "count on a many-core machine)")
    p.add_argument("--loads", nargs="+", default=LOADS, choices=LOADS)
    p.add_argument("--parts", nargs="+", default=["demo", "op", "eval"],
                   choices=["demo", "op", "eval"])
    p.add_argument("--eval-n", type=int, default=30000, help="points of the eval part")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--interleave-op", action="store_true",
                   help="the op part runs every setting in one process, --op-block calls at a "
                        "time in turn (the same moments of the load for each), instead of a "
                        "fresh process per setting")
    p.add_argument("--op-iters", type=int, default=None,
                   help="timed calls per setting, shape and mode (default 40; 120 with "
                        "--interleave-op)")
    p.add_argument("--op-block", type=int, default=10, help="calls per turn (--interleave-op)")
    p.add_argument("--op-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--op-worker-interleaved", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.op_iters is not None and args.op_iters < 1 or args.op_block < 1:
        p.error("--op-iters and --op-block must be >= 1")
    if args.eval_n < 200:
        p.error(f"--eval-n must be >= 200 (100 classes of two points at least), got {args.eval_n}")
    if args.eval_worker:
        return eval_worker(args.eval_worker, args.eval_n)
    if args.op_worker:
        return op_worker(args.op_worker, args.op_iters or 40)
    if args.op_worker_interleaved:
        return op_worker_interleaved(args.op_worker_interleaved.split(","),
                                     args.op_iters or 120, args.op_block)
    dev = device_name(torch.device("cpu"))
    commit = git_commit()
    path = results_path(args.out, torch.device("cpu"), prefix="threads_", ext=".txt")
    results = []  # (load, round, part, setting, key, value)

    def log(line):
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    interleaved = args.interleave_op and "op" in args.parts
    op_how = (f", op interleaved in one process ({args.op_iters or 120} calls per setting in "
              f"turns of {args.op_block})" if interleaved else "")
    log(f"== bench_threads: parts {args.parts}, settings {args.settings}, loads {args.loads}, "
        f"demo epochs {args.epochs}, rounds {args.rounds}{op_how} | {dev} | commit {commit} | "
        f"{utc_now()} | load {load_average()}")
    for load in args.loads:
        with Competitor(load):
            for r in range(args.rounds):
                for part in args.parts:
                    together = None
                    if part == "op" and interleaved:
                        stamp0 = f"{dev} | commit {commit} | {utc_now()} | load {load_average()}"
                        together = run_op_interleaved(args.settings, args.op_iters or 120,
                                                      args.op_block)
                    for setting in args.settings:
                        stamp = f"{dev} | commit {commit} | {utc_now()} | load {load_average()}"
                        if part == "demo":
                            wall, chosen, by_signal = run_demo(setting, args.epochs)
                            results.append((load, r, part, setting, "wall_s", wall))
                            log(f"demo load={load} round={r} threads={setting} "
                                f"epochs={args.epochs} wall_s={wall:.1f}"
                                + (f" governor={json.dumps(chosen)}" if chosen else "")
                                + (f" by_signal/decisions={json.dumps(by_signal)}"
                                   if by_signal else "")
                                + f" | {stamp}")
                        else:
                            if together is not None:
                                res, stamp = dict(together[setting]), stamp0
                            elif part == "eval":
                                res = run_eval(setting, args.eval_n)
                            else:
                                res = run_op(setting)
                            extra = {k: res.pop(k) for k in ("_governors", "_pool",
                                                             "_by_signal")}
                            for key, ms in res.items():
                                results.append((load, r, part, setting, key, ms))
                            log(f"{part} load={load} round={r} threads={setting} "
                                + " ".join(f"[{k}]={v:.3f}ms" for k, v in res.items())
                                + f" pool={extra['_pool']} governors={extra['_governors']}"
                                + f" by_signal/decisions={extra['_by_signal']}"
                                + f" | {stamp}")
    # ratios to 1 thread (same load, round, part, key): > 1 is slower than one thread
    log(f"-- summary: time / time at 1 thread (same load and round), > 1.00 = slower than one "
        f"thread | end {utc_now()} | load {load_average()}")
    base = {(l, r, part, k): v for l, r, part, s, k, v in results if s == "1"}
    for setting in args.settings:
        if setting == "1":
            continue
        for load in args.loads:
            for part in args.parts:
                ratios = [(k, r, v / base[(l, r, pt, k)]) for l, r, pt, s, k, v in results
                          if s == setting and l == load and pt == part
                          and (l, r, pt, k) in base]
                if ratios:
                    log(f"  threads={setting} load={load} {part}: " + " ".join(
                        f"[{k} r{r}]={x:.2f}" for k, r, x in ratios)
                        + f" | worst {max(x for _, _, x in ratios):.2f}")


if __name__ == "__main__":
    main()
