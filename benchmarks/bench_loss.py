"""The neighbour-kernel loss against the loss a user would write: one table of operation x
provider x pass.

    python benchmarks/bench_loss.py --device cuda --B 4096 --K 100 --D 128 512 --dtype fp32 bf16
    python benchmarks/bench_loss.py --device cpu         # the CPU grid (CPU_GRID), 2 threads
    python benchmarks/bench_loss.py --device cpu --providers fused compile checked module \
        --threads 2 --repeats 5
    python benchmarks/bench_loss.py --device cpu --B 8 --K 4 --D 16 --N 100   # smoke run

Writes ``<out>/<name>_<device>.csv`` (``--name``, default "loss"; columns
``common.TABLE_COLUMNS``), a plot beside it, and prints the table. Passes: ``forward`` (the
embeddings without grad: the forward-only op), ``backward`` (alone, after an untimed forward)
and ``both`` (forward and backward to the embeddings, and with ``--also-grad`` to sigma, the
weights or the centres too). ``--modes fwd bwd fwd_bwd`` picks them.

Times: ``wall_ms``, what a loop of calls sees (CUDA: ``common.wall_ms``, back-to-back calls;
the backward: each between two synchronisations; CPU: the median of 21 calls after 2
warm-ups), and on CUDA ``kernel_ms``, the kernels alone (``common.graph_ms``: calls captured
in one CUDA graph and replayed; the backward's is both's minus a training forward's). Peak
memory (``common.PeakMemory``): above the allocation before one call (CUDA), or above the RSS
before the warm-ups and timed calls (CPU). The bytes read are the gathered centre rows,
B x K x D x the bank's element size, for forward and both (the fused backward gathers none),
against a 1 GiB read measured in the run (``--read-mb``; on CPU in each measuring process,
beside its calls).

Providers: ``fused`` (``nnkloss.neighbour_kernel_loss``: the Triton kernels on CUDA, the
compiled CPU kernel on CPU tensors, value checks off as in a training loop after its first
step), ``eager`` (gather then logsumexp, as a user would write it), ``compile``
(``torch.compile`` of eager), ``torch`` (the op's plain PyTorch backend), ``checked``
(``fused`` with the value checks on, the default), ``module``
(``NeighbourKernelLoss(bank)(emb, labels, idx)`` over a bank holding the same lists, checks
on: the whole call a user pays) and ``module_unchecked`` (the same, checks off: what a
training step pays after its first).

On CPU every (provider, shape) runs in a fresh process (``--isolate``, the default there) at
``--threads`` threads; ``--repeats`` rounds with the providers interleaved, the median round
kept (all rounds in the row's note).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (PASSES, PeakMemory, add_worker_args, command_line,  # noqa: E402
                    device_name, git_commit, graph_ms, load_average, markdown, median_round,
                    parse_device, parse_or_work, plot, read_gbps, run_isolated, table_csv,
                    table_row, time_ms, wall_ms, worker_reply)

import torch  # noqa: E402
# torch imports torch._dynamo at the first call of a custom op or torch.compile, a large RSS
# once per process: imported here, before any memory baseline.
import torch._dynamo  # noqa: E402

import nnkloss  # noqa: E402

MODES = list(PASSES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROVIDERS = ["fused", "eager", "compile", "torch", "checked", "module", "module_unchecked"]
# Inputs besides the embeddings that may take a gradient in the bwd / fwd_bwd modes
# (--also-grad): a learned sigma, learned weights, trainable centres.
EXTRA_GRADS = ["sigma", "weights", "centres"]
# The CPU grid: (B, K, D, N, bank dtype), sigma = sqrt(D) / 2.
CPU_GRID = [(256, 100, 512, 20000, "fp32"), (1024, 32, 128, 50000, "fp32"),
            (64, 256, 2048, 10000, "fp32"), (256, 100, 512, 20000, "bf16")]
# Timed calls per mode on CPU (the median is reported): fewer leave swings of tens of percent
# on a shared machine.
CPU_ITERS = 21
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
    make_inputs) hold the inputs' lists, so the same K entries are gathered
    (``exclude_self=False``: the own centre stays in, as in the other providers). Where idx
    repeats, the last list wins for both rows (the work is the same). Uniform weights: the
    bank passes none (the kernel skips the weight gather, K * 4 bytes a row). Returns the
    provider's function of the usual seven arguments."""
    emb, labels, centres, cl, nb, w, sigma = inputs
    idx = nb[:, 0].long()
    table = torch.randint(0, centres.shape[0], (centres.shape[0], nb.shape[1]),
                          generator=torch.Generator(nb.device).manual_seed(1),
                          device=nb.device).to(nb)
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


def make_inputs(B, K, D, N, dtype, device, seed=0):
    """Embeddings near their own centre, labels, a bank of N centres (``dtype``), its labels,
    lists of K random rows with the own row first (int32, as a CentreBank stores them),
    uniform weights and sigma = sqrt(D) / 2; drawn on ``device`` (the same values on CPU
    whatever ran before)."""
    g = torch.Generator(device=device).manual_seed(seed)
    centres = torch.randn(N, D, generator=g, device=device).to(dtype)
    centre_labels = torch.randint(0, 100, (N,), generator=g, dtype=torch.int32, device=device)
    idx = torch.randint(0, N, (B,), generator=g, device=device)
    nb = torch.randint(0, N, (B, K), generator=g, dtype=torch.int32, device=device)
    emb = centres[idx].float() + 0.1 * torch.randn(B, D, generator=g, device=device)
    labels = centre_labels[idx]
    nb[:, 0] = idx
    weights = torch.ones(N, device=device)
    sigma = torch.tensor(float(D) ** 0.5 * 0.5, device=device)
    return emb, labels, centres, centre_labels, nb, weights, sigma


def gathered_bytes(B, K, D, bank_dtype):
    """B*K*D*sizeof(bank): the gathered centre rows, the bytes the "% of read" counts."""
    return B * K * D * torch.tensor([], dtype=bank_dtype).element_size()


_COMPILED = {}  # torch.compile of the eager loss, one per process


def provider_fn(provider, inputs):
    """The provider's function of the seven inputs."""
    if provider == "compile":
        if "compile" not in _COMPILED:
            _COMPILED["compile"] = torch.compile(eager_loss, dynamic=False)
        return _COMPILED["compile"]
    if provider.startswith("module"):
        return module_loss(inputs, checks=provider == "module")
    return {"fused": fused_loss, "eager": eager_loss, "torch": torch_path_loss,
            "checked": checked_loss}[provider]


def run_one(provider, mode, inputs, device, reps=100, also_grad=()):
    """One provider and mode: ``{"wall_ms", "kernel_ms", "peak_mb", "first_ms", "note"}``
    (kernel_ms None off CUDA, or with the reason in note where the calls cannot be captured
    in a CUDA graph). ``also_grad``: the inputs of EXTRA_GRADS that take a gradient too in the
    bwd and fwd_bwd modes (their .grad cleared before each backward, as zero_grad does)."""
    emb, labels, centres, cl, nb, w, sigma = inputs
    leaves = []
    if mode != "fwd" and also_grad:
        if provider.startswith("module"):
            raise ValueError("--also-grad: the module provider trains the embeddings only")
        sigma, w, centres = (t.detach().clone().requires_grad_(name in also_grad)
                             for name, t in zip(EXTRA_GRADS, (sigma, w, centres)))
        leaves = [t for t in (sigma, w, centres) if t.requires_grad]
    fn = provider_fn(provider, inputs)
    x = emb.detach().clone().requires_grad_(mode != "fwd")
    cuda = device.type == "cuda"

    def forward():
        return fn(x, labels, centres, cl, nb, w, sigma)

    def both():
        loss = forward()
        for t in [x] + leaves:
            t.grad = None
        loss.backward()

    step = forward if mode == "fwd" else both
    if mode == "bwd":
        wall, peak, first = _time_backward(forward, [x] + leaves, device)
    else:
        # the peak: on CUDA of one call after the first, on CPU over the warm-ups and the calls
        meter = PeakMemory(device).start()
        t0 = time.perf_counter()
        step()  # the first call compiles, for torch.compile
        if cuda:
            torch.cuda.synchronize(device)
        first = (time.perf_counter() - t0) * 1e3
        if cuda:
            meter.start()
            step()
            peak = meter.peak_mb()
            wall = wall_ms(step, device, reps)
        else:
            wall = time_ms(step, device, reps, warmup=1, iters=CPU_ITERS)
            peak = meter.peak_mb()
    kernel, note = None, ""
    if cuda:
        calls = max(1, min(20, int(2.0 / max(wall, 1e-3))))  # a replay of about 2 ms or more
        try:
            kernel = graph_ms(step, device, reps, calls)
            if mode == "bwd":
                kernel -= graph_ms(forward, device, reps, calls)
        except Exception as exc:  # noqa: BLE001 -- any failure to capture: the row says why
            note = "no CUDA graph: " + (str(exc).strip().splitlines() or [repr(exc)])[0][:160]
            torch.cuda.synchronize(device)
    return {"wall_ms": wall, "kernel_ms": kernel, "peak_mb": peak, "first_ms": first,
            "note": note}


def _time_backward(forward, leaves, device, warmup=2, iters=None):
    """(median ms of ``loss.backward()`` alone, each between two synchronisations with the
    ``leaves``' .grad cleared before it; peak extra memory of the backwards above the
    allocation / RSS after their forward; the first backward's ms)."""
    cuda = device.type == "cuda"
    times, peak, first = [], 0.0, None
    for i in range(warmup + (iters or CPU_ITERS)):
        loss = forward()
        for t in leaves:
            t.grad = None
        meter = PeakMemory(device).start()
        t = time.perf_counter()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t) * 1e3
        peak = max(peak, meter.peak_mb())
        first = ms if first is None else first
        if i >= warmup:
            times.append(ms)
        del loss
    return sorted(times)[len(times) // 2], peak, first


def measure(spec, inputs=None):
    """Every requested mode of one provider and shape: ``{mode: run_one's dict, or {"error":
    ...}}``, and on CPU the read bandwidth of this process's threads before and after the
    calls (the larger kept) under ``"read_gbps"``."""
    device = torch.device(spec["device"])
    if inputs is None:
        inputs = make_inputs(spec["B"], spec["K"], spec["D"], spec["N"], DTYPES[spec["dtype"]],
                             device)
    nbytes = spec["read_mb"] << 20
    reads = [read_gbps(device, nbytes)] if device.type == "cpu" else []
    out = {}
    with nnkloss.value_checks(False):
        for mode in spec["modes"]:
            try:
                out[mode] = run_one(spec["provider"], mode, inputs, device, spec["reps"],
                                    spec["also_grad"])
            except torch.OutOfMemoryError:
                out[mode] = {"error": "out of memory"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if reads:
        reads.append(read_gbps(device, nbytes))
    return {"modes": out, "read_gbps": max(reads, default=None)}


def worker(spec):
    """One provider and shape in this (fresh) process, at exactly ``threads`` threads."""
    torch.set_num_threads(spec["threads"])
    worker_reply(measure(spec))


def shapes(args, device):
    """(B, K, D, N, dtype) to measure: the explicit grid, or CPU_GRID on CPU by default."""
    if device.type == "cpu" and not any([args.B, args.K, args.D, args.N, args.dtype]):
        return list(CPU_GRID)
    return [(B, K, D, args.N or 1_000_000, dt) for dt, B, K, D in itertools.product(
        args.dtype or ["fp32", "bf16"], args.B or [256, 1024, 4096], args.K or [32, 100, 256],
        args.D or [64, 512, 2048])]


def grads_label(mode, also_grad) -> str:
    """What took a gradient in a row ("" in the forward-only mode)."""
    if mode == "fwd":
        return ""
    return "+".join(["emb"] + [g for g in EXTRA_GRADS if g in also_grad])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, nargs="+", help="default 256 1024 4096")
    ap.add_argument("--K", type=int, nargs="+", help="default 32 100 256")
    ap.add_argument("--D", type=int, nargs="+", help="default 64 512 2048")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), help="default fp32 bf16")
    ap.add_argument("--N", type=int, help="bank rows (default 1M: >> L2)")
    ap.add_argument("--providers", nargs="+", default=["fused", "eager", "compile"],
                    choices=PROVIDERS)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=MODES,
                    help="fwd: forward, embeddings without grad; bwd: backward alone; "
                         "fwd_bwd: both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each measurement in a fresh process (default: on CPU)")
    ap.add_argument("--reps", type=int, default=100, help="ms of timed calls per figure (CUDA)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per shape, providers interleaved; the median round is kept")
    ap.add_argument("--also-grad", nargs="+", choices=EXTRA_GRADS, default=[],
                    help="inputs that take a gradient besides the embeddings in the bwd and "
                         "fwd_bwd modes (a learned sigma, learned weights, trainable centres)")
    ap.add_argument("--read-mb", type=int, default=1024,
                    help="MiB of the sequential read the percentages are held against")
    ap.add_argument("--name", default="loss", help="the benchmark's name in the CSV's file name")
    add_worker_args(ap)
    args = parse_or_work(ap, argv, worker)
    if args is None:
        return 0
    device = parse_device(ap, args.device)
    isolate = device.type == "cpu" if args.isolate is None else args.isolate
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    name, commit = device_name(device), git_commit()
    command = command_line(__file__, argv)
    # the read every row is held against on CUDA, on CPU where its process took none
    run_read = read_gbps(device, args.read_mb << 20)
    print(f"device: {name} | commit {commit} | threads {threads} | "
          f"{'a fresh process per provider and shape' if isolate else 'in process'} | "
          f"read {run_read:.1f} GB/s | load {load_average()}")
    if device.type != "cuda":
        print("kernel_ms: skipped (the kernels alone are timed through CUDA graphs: CUDA only)")
    rows = []
    with table_csv(args.out, args.name, device) as out:
        for B, K, D, N, dt in shapes(args, device):
            spec = {"modes": args.modes, "B": B, "K": K, "D": D, "N": N, "dtype": dt,
                    "device": str(device), "threads": args.threads, "reps": args.reps,
                    "also_grad": args.also_grad, "read_mb": args.read_mb}
            inputs = None
            if not isolate:
                torch._dynamo.reset()  # each shape compiles afresh: no recompile limit met
                try:
                    inputs = make_inputs(B, K, D, N, DTYPES[dt], device)
                except torch.OutOfMemoryError:
                    print(f"skip B={B} K={K} D={D} {dt}: the bank does not fit")
                    continue
            runs = {p: [] for p in args.providers}
            for _ in range(args.repeats):
                for prov in args.providers:
                    one = dict(spec, provider=prov)
                    res = (run_isolated(os.path.abspath(__file__), one) if isolate
                           else measure(one, inputs))
                    runs[prov].append(res)
            for prov in args.providers:
                for mode in args.modes:
                    row = _row(prov, mode, runs[prov], (B, K, D, N, dt), run_read,
                               args.also_grad)
                    row.update(threads=threads, device=name, commit=commit, command=command)
                    out.write(row, echo=False)
                    rows.append(row)
                    print(f"    {prov} {mode} B={B} K={K} D={D} {dt}: wall {row['wall_ms']} ms,"
                          f" kernels {row['kernel_ms'] or '-'} ms, peak {row['peak_mb']} MB"
                          f" {row['note']}", flush=True)
            del inputs
    plot(rows, out.path[:-4] + ".png", f"neighbour-kernel loss: {name} @ {commit}")
    print(markdown(rows))
    return out.path


def _row(prov, mode, rounds, shape, run_read, also_grad):
    """The table's row of one provider and mode over its rounds: the median round's times
    and its process's read, the largest peak memory; an error as the note."""
    B, K, D, N, dt = shape
    args = ("loss", prov, PASSES[mode], f"B={B} K={K} D={D} N={N}", dt)
    errors = [r.get("error") or r["modes"][mode].get("error") for r in rounds
              if r.get("error") or r["modes"][mode].get("error")]
    if errors:
        return table_row(*args, note=errors[0])
    med = median_round(rounds, key=lambda r: r["modes"][mode]["wall_ms"])
    m = med["modes"][mode]
    notes = [grads_label(mode, also_grad) if also_grad else "", m["note"]]
    if len(rounds) > 1:
        notes.append("rounds " + " ".join(f"{r['modes'][mode]['wall_ms']:.4g}" for r in rounds))
    return table_row(*args, wall_ms=m["wall_ms"], kernel_ms=m["kernel_ms"],
                     peak_mb=max(r["modes"][mode]["peak_mb"] for r in rounds),
                     read_bytes=None if mode == "bwd" else gathered_bytes(B, K, D, DTYPES[dt]),
                     read_gbps=med["read_gbps"] or run_read,
                     note="; ".join(n for n in notes if n))


if __name__ == "__main__":
    main()
