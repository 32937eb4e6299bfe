"""Microbenchmark of the neighbour-kernel loss: fused op vs eager PyTorch vs torch.compile.

    python benchmarks/bench_loss.py                      # full grid on the current CUDA device
    python benchmarks/bench_loss.py --device cpu         # the CPU grid (CPU_GRID), 2 threads
    python benchmarks/bench_loss.py --B 1024 --K 100 --D 512 --dtype bf16
    python benchmarks/bench_loss.py --device cpu --B 8 --K 4 --D 16 --N 100   # smoke run
    python benchmarks/bench_loss.py --device cpu --also-grad sigma    # a learned sigma too

Appends one row per (provider, mode, shape) to ``benchmarks/results/<device>.csv`` with columns
``op,provider,mode,B,K,D,dtype,ms,gbps,peak_mem_mb,device,commit`` (and the limits, the load,
the date, ``grads``: what took a gradient, see ``--also-grad``, ``compile_mode``: the
``--compile-mode``, and ``run``: an id of the invocation, so that a table joins one run's rows)
and draws ``benchmarks/results/<device>.png`` (time and GB/s per shape). ``gbps`` counts the
bytes the op must read (docs/MATHS.md section 9): the gathered centres
``B*K*D*sizeof(bank)`` plus the index, label and weight traffic and the embeddings, whatever the
provider actually moves, so the providers compare on one scale. A row that ran out of memory is written with ms = "oom".

Providers: ``fused`` (the op as users call it: the Triton kernels on CUDA, the compiled CPU
kernel ``nnkloss.ops.cpu`` on CPU tensors; value checks off, as in a training loop after its
first step), ``eager`` (gather then logsumexp, as a user would write it),
``compile`` (``torch.compile`` of eager), ``fused_compile`` (the op's call inside
``torch.compile``: the op is opaque to it, the mean and the backward's small ops around it are
compiled; with ``--compile-mode reduce-overhead`` both compile providers replay CUDA graphs on
a GPU), ``torch`` (the op's plain PyTorch path),
``checked`` (``fused`` with the value checks on, the default) and ``module``
(``NeighbourKernelLoss(bank)(emb, labels, idx)`` over a bank holding the same lists, checks
on: the whole call a user of the module pays, lists fetched by the bank), ``module_unchecked``
(the same call with the checks off, as ``Trainer`` makes it after each fit()'s first step:
what a GPU training step pays, no host sync), ``module_compile`` (that call inside
``torch.compile``, as a user would compile it; with ``--compile-mode reduce-overhead`` under
CUDA graphs, the bank's tensors left as the module holds them, not marked static: what a user
gets).

On CUDA: ``triton.testing.do_bench`` median (``--timer do_bench``, the default: an L2 flush
before each call, which overlaps the host's launch of a host-bound call, so its figure there is
neither the wall time nor the kernels'), or ``--timer wall`` (``common.wall_ms``: back-to-back
calls, one synchronisation per round, what a training loop sees), for the fwd and fwd_bwd modes
(the CSV's ``timer``); peak = max_memory_allocated above the allocation before the measured
call. On CPU every (provider, mode, shape) runs in a fresh process
(``--isolate``, the default there) with ``--threads`` threads: the median of 21 calls after 2
warm-ups (the first one compiles, for ``compile``), and ``peak_mem_mb`` = the peak RSS above
the process's RSS after the inputs are set up and torch._dynamo is imported (torch imports it
on the first call of any custom op, ~150 MB once per process), over the warm-ups and the timed
calls (``common.PeakRss``: VmHWM reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from nnkloss.atomic import atomic_write  # noqa: E402
from common import (PeakRss, ResultsCsv, add_worker_args, device_name, git_commit,  # noqa: E402
                    load_average, max_limits, median_round, parse_device, parse_or_work,
                    process_limits, read_gbps, results_path, run_isolated, time_ms, utc_now,
                    wall_ms, worker_reply)

import torch  # noqa: E402

import nnkloss  # noqa: E402

COLUMNS = ["op", "provider", "mode", "B", "K", "D", "dtype", "ms", "gbps", "peak_mem_mb",
           "device", "commit", "gathered_gbps", "pct_of_read", "read_gbps", "threads", "load",
           "date", "bank_read_gbps", "pct_of_bank_read", "gather_gbps", "pct_of_gather",
           "grads", "timer", "compile_mode", "run"]
# compile_mode: --compile-mode of the invocation (rows written before the column: "default",
# see row_compile_mode); run: an id of the invocation that wrote the row, so that a table is
# made of one run's rows ("" in rows written before the column).
# Inputs besides the embeddings that may take a gradient in the bwd / fwd_bwd modes
# (--also-grad): a learned sigma, learned weights, trainable centres. The CSV's "grads" column
# names them ("emb", "emb+sigma", ...).
EXTRA_GRADS = ["sigma", "weights", "centres"]
MODES = ["fwd", "bwd", "fwd_bwd"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROVIDERS = ["fused", "eager", "compile", "fused_compile", "torch", "checked", "module",
             "module_unchecked", "module_compile"]
# The compiled providers and what each compiles (module_compile: the module's checks-off call,
# built for the inputs by module_loss).
COMPILED = ("compile", "fused_compile", "module_compile")
# torch.compile's mode for the compile and fused_compile providers (--compile-mode):
# "reduce-overhead" replays CUDA graphs on a GPU, which takes the host's time per call away.
COMPILE_MODE = {"mode": "default"}
# The timer of the fwd and fwd_bwd modes on CUDA (--timer): "do_bench" or "wall" (common.wall_ms).
TIMER = {"timer": "do_bench"}
# The CPU grid (issue 12): (B, K, D, N, bank dtype), sigma = sqrt(D) / 2.
CPU_GRID = [(256, 100, 512, 20000, "fp32"), (1024, 32, 128, 50000, "fp32"),
            (64, 256, 2048, 10000, "fp32"), (256, 100, 512, 20000, "bf16")]


def eager_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    """The loss the way a user would write it in PyTorch: gather (B, K, D), then logsumexp."""
    valid = neighbours >= 0
    safe = neighbours.clamp_min(0)
    c = centres[safe].float()                                   # (B, K, D)
    d = ((emb.float()[:, None, :] - c) ** 2).sum(-1)
    logits = torch.log(weights[safe]) - d / (2 * sigma * sigma)
    logits = logits.masked_fill(~valid, float("-inf"))
    same = valid & (centre_labels[safe] == labels[:, None])
    lse = torch.logsumexp(logits, 1)
    lse_pos = torch.logsumexp(logits.masked_fill(~same, float("-inf")), 1)
    ok = torch.isfinite(lse_pos)
    rows = torch.where(ok, lse - lse_pos, torch.zeros_like(lse))
    return rows.sum() / ok.sum().clamp_min(1)


def fused_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    """The op as users call it: the Triton kernels on CUDA, the compiled kernel on CPU."""
    return nnkloss.neighbour_kernel_loss(emb, labels, centres, centre_labels, neighbours,
                                         weights, sigma)


def checked_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    """The op as users call it by default: with its value checks on (the benchmark runs with
    them off, as a training loop's later steps do)."""
    with nnkloss.value_checks(True):
        return fused_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma)


def module_loss(inputs, checks: bool = True):
    """The module as users call it, ``NeighbourKernelLoss(bank)(emb, labels, idx)``, value
    checks on (``checks=False``: off, as a training loop's later steps): a CentreBank of the
    inputs' centres whose rows ``idx = neighbours[:, 0]`` (each row's own centre:
    make_inputs) hold the inputs' lists, so the same K entries are
    gathered (``exclude_self=False``: the own centre stays in, as in the other providers).
    Where idx repeats, the last list wins for both rows (a few rows at the CPU grid's shapes;
    the work is the same). Uniform weights: the bank passes none (the kernel skips the weight
    gather, K * 4 bytes a row, under 1% of the gathered bytes at D >= 128). Returns the
    provider's function of the usual seven arguments."""
    emb, labels, centres, cl, nb, w, sigma = inputs
    idx = nb[:, 0].long()
    table = torch.randint(0, centres.shape[0], (centres.shape[0], nb.shape[1]),
                          generator=torch.Generator().manual_seed(1)).to(nb)
    table[idx] = nb
    bank = nnkloss.CentreBank(centres, cl, neighbours=table)
    loss = nnkloss.NeighbourKernelLoss(bank, sigma=float(sigma), exclude_self=False)

    def call(emb, labels, centres, centre_labels, neighbours, weights, sigma):
        with nnkloss.value_checks(checks):
            return loss(emb, labels, idx)
    return call


def torch_path_loss(emb, labels, centres, centre_labels, neighbours, weights, sigma):
    return nnkloss.neighbour_kernel_loss(emb, labels, centres, centre_labels, neighbours,
                                         weights, sigma, backend="torch")


def bytes_needed(B, K, D, bank_dtype, idx_dtype, mode):
    """Bytes the op must move (the model of kernels/static_build.bytes_per_row): per row the K
    gathered centre rows, list entries and centre labels (as a CentreBank stores them: the
    lists' integer width), weights (fp32), the embedding and label; grad_x, the loss and two
    log-sum-exps written. The (B, K) distances are not stored: the benchmarked gradient goes to
    the embeddings only. fwd_bwd adds the backward's read of grad_x and write of d emb; bwd
    (the backward alone) is those two only."""
    if mode == "bwd":
        return B * D * 4 * 2
    esize = torch.tensor([], dtype=bank_dtype).element_size()
    isize = torch.tensor([], dtype=idx_dtype).element_size()
    per_entry = isize + isize + 4  # index, centre label, weight
    total = B * (K * (D * esize + per_entry) + D * 4 + 8) + B * (D * 4 + 3 * 4)
    if mode == "fwd_bwd":
        total += B * D * 4 * 2
    return total


def make_inputs(B, K, D, N, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    centres = torch.randn(N, D, generator=g).to(device=device, dtype=dtype)
    # Lists and centre labels as a CentreBank stores them: int32.
    centre_labels = torch.randint(0, 100, (N,), generator=g, dtype=torch.int32).to(device)
    idx = torch.randint(0, N, (B,), generator=g).to(device)
    # Neighbours: random bank rows, with the query's own class guaranteed in the first entry.
    nb = torch.randint(0, N, (B, K), generator=g, dtype=torch.int32).to(device)
    emb = (centres[idx].float() + 0.1 * torch.randn(B, D, generator=g).to(device))
    labels = centre_labels[idx]
    nb[:, 0] = idx
    weights = torch.ones(N, device=device)
    sigma = torch.tensor(float(D) ** 0.5 * 0.5, device=device)
    return emb, labels, centres, centre_labels, nb, weights, sigma


def gathered_bytes(B, K, D, bank_dtype):
    """B*K*D*sizeof(bank): the gathered centre rows, the bytes the "% of read" counts."""
    return B * K * D * torch.tensor([], dtype=bank_dtype).element_size()


def run_one(provider, mode, inputs, device, reps, also_grad=()):
    """(median ms, peak extra memory in MiB, first call ms) of one provider and mode.

    fwd: the loss of embeddings that do not require grad (the forward-only op); fwd_bwd: the
    loss and its backward to the embeddings; bwd: the backward alone (each timed call first
    runs an untimed forward). ``also_grad``: inputs of EXTRA_GRADS that take a gradient too in
    the bwd and fwd_bwd modes (their .grad is cleared before each backward, as a training
    step's zero_grad does)."""
    emb, labels, centres, cl, nb, w, sigma = inputs
    leaves = []
    if mode != "fwd" and also_grad:
        if provider.startswith("module"):
            raise ValueError("--also-grad: the module provider trains the embeddings only")
        sigma = sigma.detach().clone().requires_grad_("sigma" in also_grad)
        w = w.detach().clone().requires_grad_("weights" in also_grad)
        centres = centres.detach().clone().requires_grad_("centres" in also_grad)
        leaves = [t for t in (sigma, w, centres) if t.requires_grad]
    # torch imports torch._dynamo (~150 MB RSS, once per process) on the first call of any
    # torch.library custom op -- the op's -- and in torch.compile: imported before the memory
    # baseline for every provider, so that peak_mem_mb is what the calls themselves need.
    import torch._dynamo  # noqa: F401
    fn = {"fused": fused_loss, "eager": eager_loss, "torch": torch_path_loss,
          "checked": checked_loss}.get(provider)
    if provider in COMPILED:
        if COMPILE_MODE["mode"] == "reduce-overhead" and provider != "module_compile":
            # CUDA graphs copy every input they are not told is static into their own buffer
            # on each replay: the whole bank (0.5-2 GB here) per call, the first GPU run's
            # mistake (forward peak = the bank's size). A training loop holds the bank, its
            # labels and weights and sigma in place (module buffers / parameters); the batch
            # (embeddings, labels, lists) is new each step and is copied.
            for t in (centres, cl, w, sigma):
                torch._dynamo.mark_static_address(t)
        if provider not in _COMPILED:
            target = {"compile": eager_loss, "fused_compile": fused_loss}.get(provider)
            _COMPILED[provider] = torch.compile(
                target or module_loss(inputs, checks=False), dynamic=False,
                mode=COMPILE_MODE["mode"])
        fn = _COMPILED[provider]
    elif provider.startswith("module"):
        fn = module_loss(inputs, checks=provider == "module")
    if (provider in ("fused", "checked") or provider.startswith("module")) and device.type == "cpu":
        from nnkloss.ops import cpu
        cpu.available()  # build / load the library before the memory baseline
    x = emb.detach().clone().requires_grad_(mode != "fwd")

    def step():
        loss = fn(x, labels, centres, cl, nb, w, sigma)
        if mode == "fwd_bwd":
            for t in [x] + leaves:
                t.grad = None
            loss.backward()
        return loss

    if mode == "bwd":
        return _time_backward(lambda: fn(x, labels, centres, cl, nb, w, sigma), [x] + leaves,
                              device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        step()  # compile / autotune outside the measured region
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        timer = wall_ms if TIMER["timer"] == "wall" else time_ms
        return timer(step, device, reps), peak, first
    rss = PeakRss().start()
    t0 = time.perf_counter()
    step()  # the first of the two warm-ups (compiles, for torch.compile)
    first = (time.perf_counter() - t0) * 1e3
    ms = time_ms(step, device, reps, warmup=1, iters=CPU_ITERS)
    return ms, rss.peak_mb(), first


_COMPILED = {}  # one torch.compile per provider and process, shared by the modes measured there
# Timed calls per mode on CPU (the median is reported): 7 left run-to-run swings of 10-25% on
# the shared 2-core machine.
CPU_ITERS = 21


def _time_backward(forward, leaves, device, warmup=2, iters=None):
    """Median ms of ``loss.backward()`` alone (the ``leaves``' .grad cleared before each),
    peak extra memory of the backwards (above the RSS / allocation after their forward), first
    backward's ms."""
    cuda = device.type == "cuda"
    iters = iters or CPU_ITERS
    times, peak, first = [], 0.0, None
    for i in range(warmup + iters):
        loss = forward()
        for t in leaves:
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            rss = PeakRss().start()
        t = time.perf_counter()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        if cuda:
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2 ** 20)
        else:
            peak = max(peak, rss.peak_mb())
        first = ms if first is None else first
        if i >= warmup:
            times.append(ms)
        del loss
    return sorted(times)[len(times) // 2], peak, first


def worker(spec):
    """The measurements of one provider and shape, every requested mode, in this (fresh)
    process; replies with a JSON line ``{"modes": {mode: {...}}, "idx_dtype": ...}``.
    The CPU op's thread governors are off here (NNKLOSS_GOVERN_THREADS=0): the op runs at
    exactly ``--threads`` threads; benchmarks/bench_threads.py measures the governed default."""
    os.environ["NNKLOSS_GOVERN_THREADS"] = "0"
    torch.set_num_threads(spec["threads"])
    COMPILE_MODE["mode"] = spec.get("compile_mode", "default")
    TIMER["timer"] = spec.get("timer", "do_bench")
    device = torch.device(spec["device"])
    inputs = make_inputs(spec["B"], spec["K"], spec["D"], spec["N"], DTYPES[spec["dtype"]],
                         device)
    out = {}
    # The limits on these threads, measured before and after the calls (the larger kept): the
    # machine's sequential read; the bank's own (the CPU grid's banks are 20-82 MB, partly or
    # wholly in a 32 MiB last-level cache); and the gather limit, a read of exactly the rows
    # the op gathers in its order and nothing else (common.gather_gbps).
    limits = _limits(inputs)
    with nnkloss.value_checks(False):
        for mode in spec.get("modes", [spec.get("mode")]):
            try:
                ms, peak, first = run_one(spec["provider"], mode, inputs, device, spec["reps"],
                                          spec.get("also_grad", ()))
                out[mode] = {"ms": ms, "peak": peak, "first_ms": first}
            except torch.OutOfMemoryError:
                out[mode] = {"oom": True}
    limits = max_limits([limits, _limits(inputs)])
    worker_reply({"modes": out, "idx_dtype": str(inputs[4].dtype), "limits": limits})


# Bytes of the STREAM-like read that each measuring process takes beside its calls (tests
# shrink it).
PROCESS_READ_BYTES = 2 ** 30


def _limits(inputs):
    """common.process_limits of the shape's bank and lists (the machine's read on CPU only: on
    a GPU the run's own read serves, and a 1 GiB read per provider and shape would add ~8 s to
    gpu_session.sh's timed steps)."""
    return process_limits(inputs[2], inputs[4], PROCESS_READ_BYTES)


def measure_copy_gbps(device, nbytes=2 ** 31):
    """Device-to-device copy bandwidth (bytes read + written), the ceiling the targets use."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, 200)
    return 2 * nbytes / ms / 1e6


MODE_HEAD = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}


def row_compile_mode(row) -> str:
    """A row's torch.compile mode: its "compile_mode", "default" where the row was written
    before the column (or by a run that left it empty)."""
    return row.get("compile_mode") or "default"


def compile_modes_note(rows) -> str:
    """The torch.compile modes of the compiled providers' ``rows``, comma-separated, or "" when
    they are the default (said above the table and in the plot's title only then)."""
    modes = sorted({row_compile_mode(r) for r in rows if r["provider"] in COMPILED})
    return "" if modes in ([], ["default"]) else ", ".join(modes)


def loss_rows(csv_path, commit, grads="emb", run=None):
    """The loss rows of ONE run at ``commit`` that ``summary`` and ``plot`` show: the forward
    rows and the backward / forward+backward rows whose gradients went to ``grads`` (rows
    written before the CSV's "grads" column trained the embeddings only); per shape,
    provider and mode the last such row (a repeated measurement within the run).

    ``run``: the CSV's "run" id of the run; default the run of the last such row at that
    commit. Rows of other runs at the same commit are left out: before, a later run's rows
    replaced an earlier run's per shape, provider and mode, so that one table mixed, say, one
    run's fused rows with another's reduce-overhead compile rows. Rows written before the
    "run" column (run "") count as one run, as they did."""
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == "loss" and r["commit"] == commit
                and r["ms"] not in ("oom", "")
                and (r["mode"] == "fwd" or (r.get("grads") or "emb") == grads)]
    if run is None and rows:
        run = rows[-1].get("run") or ""
    rows = [r for r in rows if (r.get("run") or "") == (run or "")]
    last = {}
    for r in rows:
        last[(r["B"], r["K"], r["D"], r["dtype"], r["provider"], r["mode"])] = r
    return list(last.values())


def plot_data(rows):
    """What ``plot`` draws from ``loss_rows``: the shapes in the rows' order, the modes and
    providers present (in MODES and PROVIDERS order), and per (mode, provider) the ms and
    the "% of read" of each shape (NaN where there is no row or no figure)."""
    nan = float("nan")
    shapes = list(dict.fromkeys((r["B"], r["K"], r["D"], r["dtype"]) for r in rows))
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    at = {(r["B"], r["K"], r["D"], r["dtype"], r["provider"], r["mode"]): r for r in rows}
    ms, pct = {}, {}
    for m in modes:
        for p in provs:
            hits = [at.get(s + (p, m)) for s in shapes]
            ms[m, p] = [float(h["ms"]) if h else nan for h in hits]
            pct[m, p] = [float(h["pct_of_read"]) if h and h.get("pct_of_read") else nan
                         for h in hits]
    return shapes, modes, provs, ms, pct


# The goal for the op's reading (issue 21): 80% of the machine's read bandwidth.
READ_GOAL_PCT = 80


def plot(csv_path, png_path, commit, grads="emb", run=None):
    """One figure for one commit's rows (``loss_rows``): a row of panels per mode, grouped
    bars per shape with a bar per provider; left the time (ms, log scale), right the gathered
    rows' "% of read" (none for the backward, which reads no gathered rows) against the 80%
    goal. Nothing is drawn where the commit has no rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = loss_rows(csv_path, commit, grads, run)
    if not rows:
        return
    shapes, modes, provs, ms, pct = plot_data(rows)
    n, w = len(shapes), 0.8 / max(1, len(provs))
    fig, axes = plt.subplots(len(modes), 2, figsize=(max(9, 1.6 * n + 4), 3.2 * len(modes)),
                             squeeze=False)
    labels = [f"B {b}, K {k}\nD {d}, {dt}" for b, k, d, dt in shapes]
    for i, m in enumerate(modes):
        left, right = axes[i]
        for j, p in enumerate(provs):
            xs = [x + (j - (len(provs) - 1) / 2) * w for x in range(n)]
            left.bar(xs, ms[m, p], w, label=p, color=f"C{j}")
            if m != "bwd":
                right.bar(xs, pct[m, p], w, label=p, color=f"C{j}")
        left.set_yscale("log")
        left.set_ylabel(f"{MODE_HEAD[m]}, ms")
        if m == "bwd":
            right.axis("off")
            right.text(0.5, 0.5, "the backward reads no gathered rows", ha="center",
                       va="center", transform=right.transAxes)
        else:
            right.axhline(READ_GOAL_PCT, color="k", ls="--", lw=1)
            right.axhline(100, color="0.6", ls=":", lw=1)
            right.set_ylabel(f"{MODE_HEAD[m]}, % of read")
        for ax in (left, right):
            ax.set_xticks(range(n))
            ax.set_xticklabels(labels, fontsize=7)
    axes[0][0].legend(fontsize=8)
    extra = "" if grads == "emb" else f", gradients to {grads.replace('+', ', ')}"
    modes_note = compile_modes_note(rows)
    if modes_note:
        extra += f", compile mode {modes_note}"
    fig.suptitle(f"neighbour-kernel loss: {rows[-1]['device']} @ {commit}, "
                 f"{rows[-1]['date'][:10]}{extra} (dashed: the 80% goal)")
    fig.tight_layout()
    try:
        atomic_write(png_path, lambda f: fig.savefig(f, dpi=110, format="png"))
    finally:
        plt.close(fig)


def grads_label(mode, also_grad) -> str:
    """The CSV's "grads" of a row: what took a gradient ("" in the forward-only mode)."""
    if mode == "fwd":
        return ""
    return "+".join(["emb"] + [g for g in EXTRA_GRADS if g in also_grad])


def summary(csv_path, commit, mode=None, grads="emb", run=None):
    """Markdown, in the style of Cut Cross-Entropy's tables: one table for the operation
    (the loss), a row per shape and provider, time and peak extra memory of forward / backward
    / forward+backward, and for forward and forward+backward the bytes gathered per second
    against two limits measured in the same run: "% of read" (a 1 GiB sequential read: memory)
    and "% of gather" (a read of exactly the rows the op gathers, in its order, from wherever
    the bank lives: what a random row gather of that shape can reach; its CSV columns sit
    beside those of a sequential read of the bank, ``pct_of_bank_read``); then the fused op's
    speed-up over each other provider. ``mode``: only that mode's columns (default: every
    mode). ``grads``: the backward and forward+backward rows whose gradients went to these
    inputs ("emb", "emb+sigma", ...: the CSV's "grads"; rows written before that column
    trained the embeddings only); the forward does not depend on it. ``run``: which run at
    that commit (:func:`loss_rows`; default the latest). A compile mode other than the
    default is said above the table."""
    rows = loss_rows(csv_path, commit, grads, run)
    modes = [m for m in MODES if any(r["mode"] == m for r in rows) and mode in (None, m)]
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["K"], r["D"], r["dtype"]), {}).setdefault(
            r["provider"], {})[r["mode"]] = r
    provs = [p for p in PROVIDERS if any(p in v for v in by.values())]
    pct_modes = [m for m in modes if m != "bwd"]
    head = (["B, K, D, bank", "provider"] + [f"{MODE_HEAD[m]} ms" for m in modes]
            + [f"{MODE_HEAD[m]} MB" for m in modes]
            + [f"{MODE_HEAD[m]} % of read" for m in pct_modes]
            + [f"{MODE_HEAD[m]} % of gather" for m in pct_modes])
    lines = [] if grads == "emb" else [f"Gradients to: {grads.replace('+', ', ')}.", ""]
    modes_note = compile_modes_note(rows)
    if modes_note:
        lines = [f"torch.compile mode: {modes_note}.", ""] + lines
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (B, K, D, dt), v in by.items():
        for p in provs:
            if p not in v:
                continue
            cells = [f"{B}, {K}, {D}, {dt}", p]
            cells += [v[p][m]["ms"] if m in v[p] else "" for m in modes]
            cells += [v[p][m]["peak_mem_mb"] if m in v[p] else "" for m in modes]
            for col in ("pct_of_read", "pct_of_gather"):
                cells += [f"{float(v[p][m][col]):.0f}%" if m in v[p] and v[p][m].get(col)
                          else "" for m in pct_modes]
            lines.append("| " + " | ".join(cells) + " |")
    others = [p for p in provs if p != "fused"]
    if "fused" in provs and others:
        head = ["B, K, D, bank"] + [f"fused vs {p}, {MODE_HEAD[m]}" for p in others
                                    for m in modes]
        lines += ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for (B, K, D, dt), v in by.items():
            cells = [f"{B}, {K}, {D}, {dt}"]
            for p in others:
                for m in modes:
                    ok = m in v.get(p, {}) and m in v.get("fused", {})
                    cells.append(f"{float(v[p][m]['ms']) / float(v['fused'][m]['ms']):.2f}x"
                                 if ok else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine_repeats(runs):
    """One provider's measurements of one shape over the rounds (each ``(per_mode, idx_dtype,
    limits)``, a round being one measuring process): per mode the median round's ms (the upper
    one for an even count) and the limits measured in that round's process (a figure and the
    limit it is held against taken minutes apart would measure two machines:
    common.process_limits), the largest peak memory, the first round's first call; out of memory if any
    round was."""
    per_mode = {}
    for mode in runs[0][0]:
        rs = [r[0][mode] for r in runs]
        if any(r.get("oom") for r in rs):
            per_mode[mode] = {"oom": True}
            continue
        median = median_round(range(len(rs)), key=lambda i: rs[i]["ms"])
        per_mode[mode] = {"ms": rs[median]["ms"], "peak": max(r["peak"] for r in rs),
                          "first_ms": rs[0]["first_ms"], "rounds": [r["ms"] for r in rs],
                          "limits": runs[median][2] or {}}
    return per_mode, runs[0][1]


def shapes(args, device):
    """(B, K, D, N, dtype) to measure: the explicit grid, or CPU_GRID on CPU by default."""
    if device.type == "cpu" and not any([args.B, args.K, args.D, args.N, args.dtype]):
        return list(CPU_GRID)
    return [(B, K, D, args.N or 1_000_000, dt) for dt, B, K, D in itertools.product(
        args.dtype or ["fp32", "bf16"], args.B or [256, 1024, 4096], args.K or [32, 100, 256],
        args.D or [64, 512, 2048])]


def main(argv=None):
    # The fused op validates values (one host sync) by default; a training loop turns that off.
    with nnkloss.value_checks(False):
        return _main(argv)


def _main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, nargs="+", help="default 256 1024 4096")
    ap.add_argument("--K", type=int, nargs="+", help="default 32 100 256")
    ap.add_argument("--D", type=int, nargs="+", help="default 64 512 2048")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), help="default fp32 bf16")
    ap.add_argument("--N", type=int, help="bank rows (default 1M: >> L2)")
    ap.add_argument("--providers", nargs="+", default=["fused", "eager", "compile"],
                    choices=PROVIDERS)
    ap.add_argument("--compile-mode", default="default",
                    choices=["default", "reduce-overhead", "max-autotune",
                             "max-autotune-no-cudagraphs"],
                    help="torch.compile mode of the compile and fused_compile providers "
                         "(fused_compile: the op itself inside torch.compile)")
    ap.add_argument("--modes", nargs="+", choices=MODES,
                    help="default fwd bwd fwd_bwd (fwd: embeddings without grad, the "
                         "forward-only op; bwd: the backward alone)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (CPU)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each measurement in a fresh process (default: on CPU)")
    ap.add_argument("--reps", type=int, default=100, help="do_bench rep time in ms (CUDA)")
    ap.add_argument("--timer", default="do_bench", choices=["do_bench", "wall"],
                    help="CUDA's timer of the fwd and fwd_bwd modes: do_bench (an L2 flush "
                         "before each call) or wall (back-to-back calls, as a training loop)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per shape, providers interleaved; the median round is kept")
    ap.add_argument("--also-grad", nargs="+", choices=EXTRA_GRADS, default=[],
                    help="inputs that take a gradient besides the embeddings in the bwd and "
                         "fwd_bwd modes (a learned sigma, learned weights, trainable centres)")
    ap.add_argument("--copy-bandwidth", action="store_true",
                    help="also measure device-to-device copy bandwidth (row op=copy)")
    add_worker_args(ap)
    args = parse_or_work(ap, argv, worker)
    if args is None:
        return 0
    device = parse_device(ap, args.device)
    COMPILE_MODE["mode"] = args.compile_mode
    TIMER["timer"] = args.timer
    # the CSV's timer: CPU calls are each timed on their own (common.time_ms) whatever --timer
    timer = args.timer if device.type == "cuda" else "median"
    grid = shapes(args, device)
    modes = args.modes or list(MODES)
    isolate = device.type == "cpu" if args.isolate is None else args.isolate
    name = device_name(device)
    commit = git_commit()
    # This invocation's rows carry its id, so that the table and plot below (and any later
    # summary) join only its rows, not another run's at the same commit.
    run_id = f"{utc_now()}-{uuid.uuid4().hex[:8]}"
    csv_path = results_path(args.out, device, prefix="loss_")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()  # the CSV's figure: --threads on CPU, the host's on CUDA
    # A STREAM-like read on the same threads, measured in this run before each shape and after
    # the last (the largest is the "read" row). Each row's "% of read" is held against the read
    # of the processes that timed it (_limits), this one only where those took none.
    read = read_gbps(device)
    print(f"device: {name} | commit {commit} | threads {threads} | "
          f"{'a fresh process per provider and shape' if isolate else 'in process'} | "
          f"read {read:.1f} GB/s | load {load_average()}")
    results = []
    with ResultsCsv(csv_path, COLUMNS) as out:
        if args.copy_bandwidth:
            gbps = measure_copy_gbps(device)
            row = {"op": "copy", "provider": "torch", "mode": "copy", "B": 0, "K": 0, "D": 0,
                   "dtype": "fp32", "gbps": f"{gbps:.1f}", "device": name, "commit": commit,
                   "threads": threads, "load": load_average(), "date": utc_now(),
                   "timer": "do_bench" if device.type == "cuda" else "median",
                   "compile_mode": args.compile_mode, "run": run_id}
            out.write(row)
        for B, K, D, N, dt in grid:
            inputs = None
            read = max(read, read_gbps(device))  # the machine's best read of the run
            if not isolate:
                try:
                    inputs = make_inputs(B, K, D, N, DTYPES[dt], device)
                except torch.OutOfMemoryError:
                    print(f"skip B={B} K={K} D={D} {dt}: bank does not fit")
                    continue
            def measure(prov):
                if isolate:
                    res = run_isolated(os.path.abspath(__file__), {
                        "provider": prov, "modes": modes, "B": B, "K": K, "D": D, "N": N,
                        "dtype": dt, "device": str(device), "threads": args.threads,
                        "reps": args.reps, "also_grad": args.also_grad,
                        "compile_mode": args.compile_mode, "timer": args.timer})
                    if "error" in res:
                        raise RuntimeError(f"{prov} B={B} K={K} D={D}: {res['error']}")
                    idx_dtype = getattr(torch, res.get("idx_dtype", "torch.int64")[6:])
                    per_mode = res["modes"]
                    limits = res.get("limits")
                else:
                    _COMPILED.clear()
                    per_mode = {}
                    for mode in modes:
                        try:
                            ms, peak, first = run_one(prov, mode, inputs, device, args.reps,
                                                      args.also_grad)
                            per_mode[mode] = {"ms": ms, "peak": peak, "first_ms": first}
                        except torch.OutOfMemoryError:
                            per_mode[mode] = {"oom": True}
                            if device.type == "cuda":
                                torch.cuda.empty_cache()
                    idx_dtype = inputs[4].dtype
                    limits = _limits(inputs)
                return per_mode, idx_dtype, limits
            # Providers interleaved, --repeats rounds (fused, compile, fused, compile, ...); each
            # figure is the median over the rounds of the per-process medians.
            runs, loads = {p: [] for p in args.providers}, {}
            for _ in range(args.repeats):
                for prov in args.providers:
                    loads.setdefault(prov, load_average())
                    runs[prov].append(measure(prov))
            for prov in args.providers:
                load = loads[prov]
                per_mode, idx_dtype = combine_repeats(runs[prov])
                for mode in modes:
                    r = per_mode[mode]
                    if r.get("oom"):
                        results.append(["loss", prov, mode, B, K, D, dt, "oom", "", "", name,
                                        commit, "", "", "", threads, load, utc_now(), "",
                                        "", "", "", grads_label(mode, args.also_grad), timer,
                                        args.compile_mode, run_id])
                        continue
                    # the limits of the process that timed the median round ("% of read":
                    # the run's own read, below, where that process took none)
                    limits = r["limits"]
                    bank_read, gather = limits.get("bank_read_gbps"), limits.get("gather_gbps")
                    process_read = limits.get("read_gbps")
                    gbps = bytes_needed(B, K, D, DTYPES[dt], idx_dtype, mode) / r["ms"] / 1e6
                    gathered = ("" if mode == "bwd" else
                                gathered_bytes(B, K, D, DTYPES[dt]) / r["ms"] / 1e6)
                    results.append(["loss", prov, mode, B, K, D, dt, f"{r['ms']:.4g}",
                                    f"{gbps:.4g}", f"{r['peak']:.1f}", name, commit,
                                    "" if gathered == "" else f"{gathered:.4g}", gathered,
                                    process_read, threads, load, utc_now(),
                                    f"{bank_read:.4g}" if bank_read else "",
                                    "" if gathered == "" or not bank_read
                                    else f"{100 * gathered / bank_read:.1f}",
                                    f"{gather:.4g}" if gather else "",
                                    "" if gathered == "" or not gather
                                    else f"{100 * gathered / gather:.1f}",
                                    grads_label(mode, args.also_grad),
                                    # bwd: each backward between two synchronisations
                                    "synced" if mode == "bwd" and device.type == "cuda"
                                    else timer, args.compile_mode, run_id])
                    rounds = r.get("rounds", [])
                    print(f"    {prov} {mode} B={B} K={K} D={D} {dt}: {r['ms']:.4g} ms "
                          f"(N={N}, first call {r['first_ms']:.1f} ms"
                          + (", rounds " + " ".join(f"{v:.4g}" for v in rounds)
                             if len(rounds) > 1 else "") + ")", flush=True)
            del inputs
        read = max(read, read_gbps(device))
        out.write(["read", "torch", "read", 0, 0, 0, "fp32", "", f"{read:.4g}", "", name,
                   commit, "", "", f"{read:.4g}", threads, load_average(), utc_now(), "",
                   "", "", "", "", "", args.compile_mode, run_id])
        for row in results:
            if row[7] != "oom":
                row_read = row[14] or read
                row[13] = "" if row[13] == "" else f"{100 * row[13] / row_read:.1f}"
                row[14] = f"{row_read:.4g}"
            out.write(row, echo=False)
    grads = grads_label("fwd_bwd", args.also_grad)
    plot(csv_path, csv_path[:-4] + ".png", commit, grads, run=run_id)
    print(summary(csv_path, commit, grads=grads, run=run_id))
    return csv_path


if __name__ == "__main__":
    main()
