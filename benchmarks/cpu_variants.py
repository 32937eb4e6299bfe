"""A/B of the compiled CPU kernel's build-time knobs, interleaved in one process.

    python benchmarks/cpu_variants.py -D NNK_PREFETCH_LOCALITY=0 -D NNK_PREFETCH_LOCALITY=3
    python benchmarks/cpu_variants.py -D NNK_ONE_PASS_BYTES=16384 -D "" --rounds 5
    python benchmarks/cpu_variants.py -D "" -D NNK_FIXED_ROW_BYTES=0 --shape 512,64,256,50000,fp32

Each ``-D`` is one variant: macros of ``nnkloss/cpu/csrc`` (comma-separated, e.g.
``NNK_PREFETCH_LOCALITY=3,NNK_PREFETCH_BYTES=16384``; ``""`` is the source's defaults); an
item that starts with ``-`` is a compiler option added as it is (``-fno-tree-vectorize``), one
that starts with ``!`` removes an option of ``nnkloss.cpu.build.FLAGS``
(``!-fno-trapping-math``). Every variant is built into a private temporary cache (the same
verified build and load as users get), then for each of ``--rounds`` rounds and each shape of
bench_loss's CPU grid the variants run in turn (each round's order rotated by one, see
``in_turn``): the op's forward (embeddings that do not require grad) and forward+backward
(gradient to the embeddings), value checks off, at ``--threads``. Prints one line per (round,
variant, shape) with the median of ``--iters`` calls and the gathered rows' GB/s, then each
variant's median over the rounds; with ``--out`` the lines also go to a log file headed by device, commit, date and load.

Variants share one process so that the machine's drift (the 2-core VM's memory read moved
1.7x within hours) hits them alike; the rounds show what is left of the noise.

``--against REV`` adds the kernel as it was at a git revision (its sources, built the same way
with the same -D flags as the defaults), and times the kernel's calls themselves
(``nnkloss.cpu.forward`` without and with grad_x, no autograd) instead of the op, since the
library's other entry points (the backward's row scaling, the checks) may take other arguments
at another revision. ``nnk_forward``'s own parameter list must read the same in both sources,
else the run stops naming it::

    python benchmarks/cpu_variants.py -D "" --against 12c891b --rounds 5
    python benchmarks/cpu_variants.py -D "" --kernel --gather    # the kernel against its limit

``--classifier`` times the kernel classifier's distances (``nnkloss.cpu.rel_sqdist``, fp32,
bench_classifier's shapes or ``--classifier-shape Q,k,D,N``) instead of the loss, and checks
that every variant (and ``--against``'s revision) gives the first one's output bit for bit::

    python benchmarks/cpu_variants.py -D "" --against HEAD --classifier --rounds 5
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import device_name, git_commit, load_average, time_ms, utc_now  # noqa: E402

import torch  # noqa: E402

import nnkloss  # noqa: E402
from bench_loss import CPU_GRID, DTYPES, gathered_bytes, make_inputs  # noqa: E402
from nnkloss import cpu  # noqa: E402
from nnkloss.cpu import build as cpu_build  # noqa: E402


GATHER = "gather limit"


def variant_flags(defines: str, base):
    """The compiler options of a variant: ``base`` less the ``!``-items, plus ``-D`` for each
    macro item and each ``-``-item as it is. An option to remove that ``base`` lacks stops the
    run naming it."""
    items = [d.strip() for d in defines.split(",") if d.strip()]
    drop = {d[1:] for d in items if d.startswith("!")}
    missing = drop - set(base)
    if missing:
        raise SystemExit(f"variant {defines!r}: {sorted(missing)} not among the compiler "
                         f"options {list(base)}")
    return ([f for f in base if f not in drop]
            + [d if d.startswith("-") else f"-D{d}" for d in items if not d.startswith("!")])


def build(defines: str, source: dict = None):
    """The library with ``-D`` flags for the comma-separated ``defines``, in its own private
    cache directory (nnkloss.cpu.build's verified build and load); returns the loaded handle.
    ``source``: {file name: text} of another revision's sources to build instead of the
    package's (``--against``); only the symbols it has are declared."""
    b = cpu_build
    saved = (b.FLAGS, os.environ.get("NNKLOSS_CACHE_DIR"), b.SOURCES, b._declare)
    b.FLAGS = variant_flags(defines, saved[0])
    cache = tempfile.mkdtemp(prefix="nnk_variant_")
    os.environ["NNKLOSS_CACHE_DIR"] = cache
    if source is not None:
        src = os.path.join(cache, "src")
        os.mkdir(src)
        for name, text in source.items():
            with open(os.path.join(src, name), "w") as fh:
                fh.write(text)
        b.SOURCES = [os.path.join(src, n) for n in sorted(source) if n.endswith(".cpp")]
        b._declare = lambda lib: (saved[3](_Declared(lib)), lib)[1]
    try:
        b._reset_for_tests()
        if not cpu.available():
            raise SystemExit(f"variant {defines!r} did not build: {cpu.build_info()['error']}")
        return b._state["lib"]
    finally:
        # loaded through its open descriptor (build._load), so the files can go now
        shutil.rmtree(cache, ignore_errors=True)
        b.FLAGS, _, b.SOURCES, b._declare = saved
        if saved[1] is None:
            os.environ.pop("NNKLOSS_CACHE_DIR", None)
        else:
            os.environ["NNKLOSS_CACHE_DIR"] = saved[1]


class _Declared:
    """A library for build._declare that takes the declarations of the symbols it has and lets
    those of the others fall on the floor (another revision's kernel may lack them)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        try:
            return getattr(self._lib, name)
        except AttributeError:
            return types.SimpleNamespace()


def source_at(rev: str) -> dict:
    """The library's sources as they were at git revision ``rev``: {file name: text}, the files
    of ``nnkloss/cpu/csrc``, or the one ``nnkloss/ops/cpu_kernel.cpp`` of earlier revisions."""
    def git(*a):
        return subprocess.check_output(["git", *a], cwd=HERE, stderr=subprocess.PIPE, text=True)
    try:
        names = git("ls-tree", "--full-tree", "--name-only", f"{rev}:nnkloss/cpu/csrc").split()
        return {n: git("show", f"{rev}:nnkloss/cpu/csrc/{n}") for n in names}
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        return {"op.cpp": git("show", f"{rev}:nnkloss/ops/cpu_kernel.cpp")}
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--against {rev}: no library sources there "
                         f"({getattr(exc, 'stderr', '') or exc})".strip()) from None


def forward_parameters(source: str, name: str = "nnk_forward") -> str:
    """The parameter list of the library's entry point ``name`` in a kernel source, whitespace
    collapsed."""
    m = re.search(r"\bint\s+" + re.escape(name) + r"\s*\(([^)]*)\)", source)
    if m is None:
        raise SystemExit(f"no {name} in the kernel source")
    return " ".join(m.group(1).split())


def source_text(source) -> str:
    """The sources' texts as one: a {name: text} of :func:`source_at`, or a text."""
    return "\n".join(source.values()) if isinstance(source, dict) else source


def check_same_forward(rev: str, source, name: str = "nnk_forward") -> None:
    """Stop unless the entry point ``name`` takes the same parameters at ``rev`` as now (the
    calls pass today's arguments to both libraries)."""
    now = ""
    for path in cpu_build.SOURCES:
        with open(path) as fh:
            now += fh.read()
    now = forward_parameters(now, name)
    then = forward_parameters(source_text(source), name)
    if then != now:
        raise SystemExit(f"--against {rev}: {name}'s parameters differ ({then!r} there, "
                         f"{now!r} now)")


def parse_shape(text: str):
    """``"B,K,D,N,DTYPE"`` -> (B, K, D, N, dtype name), as the rows of CPU_GRID."""
    parts = text.split(",")
    if len(parts) != 5 or parts[4] not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"--shape takes B,K,D,N,DTYPE with DTYPE one of {sorted(DTYPES)}, got {text!r}")
    try:
        B, K, D, N = (int(v) for v in parts[:4])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: B, K, D and N must be integers, got "
                                         f"{text!r}") from None
    if min(B, K, D, N) < 1:
        raise argparse.ArgumentTypeError(f"--shape: B, K, D and N must be >= 1, got {text!r}")
    return (B, K, D, N, parts[4])


def use(lib) -> None:
    """Make ``lib`` the library the op calls (build.lib() returns the loaded handle)."""
    cpu_build._state["lib"] = lib


def run_header(threads: int) -> str:
    """The log's first line: device, commit, date, threads and load."""
    return (f"# {device_name(torch.device('cpu'))} | commit {git_commit()} | {utc_now()} | "
            f"threads {threads} | load {load_average()}")


def say(lines, text: str) -> None:
    """One line of the run: printed now, and kept for --out."""
    lines.append(text)
    print(text, flush=True)


def append_log(path, lines) -> None:
    """The run's lines appended to the log file ``path`` (--out), if one was given."""
    if path:
        with open(path, "a") as fh:
            fh.write("\n".join(lines) + "\n")


def parse_classifier_shape(text: str):
    """``"Q,k,D,N"`` -> (Q, k, D, N), each >= 1."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--classifier-shape takes Q,k,D,N, four integers >= 1, "
                                         f"got {text!r}")
    return shape


def in_turn(libs, r: int):
    """The variants in round r's order: the list rotated by r, so that over the rounds each
    variant runs in every position equally often. In a fixed order the round's first variant
    ran slower: two builds of the same source measured 0.383 against 0.361-0.363 ms (kernel
    forward, B 256, K 100, D 512, bf16, 7 rounds, 2026-11-27), the first of four each round."""
    k = r % len(libs)
    return libs[k:] + libs[:k]


def classifier_rounds(args, libs):
    """``--classifier``: per round, shape and variant the median of ``--iters`` calls of
    ``cpu.rel_sqdist`` (fp32, bench_classifier's inputs), then each variant's median over the
    rounds and whether every variant's output equals the first's bit for bit. Returns
    ``{(variant, shape): [ms per round]}`` and ``{shape: bit-equal}``."""
    from bench_classifier import SHAPES, setup
    dev = torch.device("cpu")
    shapes = args.cls_shapes or [tuple(int(v) for v in s.split(",")) for s in SHAPES]
    lines = []
    say(lines, run_header(args.threads) + " | the classifier's distances"
        + (f", against {args.against}" if args.against else ""))
    results, same = {}, {}
    for r in range(args.rounds):
        for shape in shapes:
            x, centres, idx, ref = setup(*shape, dev)
            gb = idx.numel() * shape[2] * 4 / 1e6
            outs = {}
            for name, lib in in_turn(libs, r):
                use(lib)
                outs[name] = cpu.rel_sqdist(x, centres, idx, ref, torch.float32)
                ms = time_ms(lambda: cpu.rel_sqdist(x, centres, idx, ref, torch.float32), dev,
                             iters=args.iters)
                results.setdefault((name, shape), []).append(ms)
                say(lines, f"round {r} | {name} | {','.join(map(str, shape))} | classifier "
                           f"distances {ms:.3f} ms ({gb / ms:.1f} GB/s)")
            first = outs[libs[0][0]]
            same[shape] = same.get(shape, True) and all(torch.equal(o, first)
                                                        for o in outs.values())
    lines.append("# medians over the rounds")
    for (name, shape), runs in results.items():
        base = statistics.median(results[(libs[0][0], shape)])
        ms = statistics.median(runs)
        say(lines, f"{name} | {','.join(map(str, shape))} | classifier distances {ms:.3f} ms "
                   f"| {base / ms:.2f}x {libs[0][0]}'s speed")
    for shape, ok in same.items():
        say(lines, f"bits | {','.join(map(str, shape))} | every variant equal to "
                   f"{libs[0][0]}'s: {ok}")
    append_log(args.out, lines)
    return results, same


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-D", dest="variants", action="append", required=True,
                    help="one variant: comma-separated macros ('' for the defaults)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into CPU_GRID (default all)")
    ap.add_argument("--shape", dest="extra", action="append", type=parse_shape, default=[],
                    metavar="B,K,D,N,DTYPE",
                    help="a shape of its own (e.g. 512,64,256,50000,fp32); repeatable. Only "
                         "these (and --shapes) are measured when given")
    ap.add_argument("--out", help="also append the lines to this log file")
    ap.add_argument("--kernel", action="store_true",
                    help="time the kernel's calls (forward without and with grad_x) instead of "
                         "the op (as --against does)")
    ap.add_argument("--gather", action="store_true",
                    help="also time the gather limit (nnkloss.cpu.gather_read: the rows "
                         "the lists name, read as the forward reads them) per round and shape, "
                         "and give each variant's figures as %% of it")
    ap.add_argument("--against", metavar="REV",
                    help="also the kernel of git revision REV; times the kernel's calls")
    ap.add_argument("--classifier", action="store_true",
                    help="time the classifier's distances (cpu.rel_sqdist) instead of the "
                         "loss, every variant's output checked against the first's bits")
    ap.add_argument("--classifier-shape", dest="cls_shapes", action="append",
                    type=parse_classifier_shape, default=[], metavar="Q,k,D,N",
                    help="a classifier shape of its own (default: bench_classifier's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    libs = [(v or "defaults", build(v)) for v in args.variants]
    if args.against:
        source = source_at(args.against)
        check_same_forward(args.against, source,
                           "nnk_rel_sqdist" if args.classifier else "nnk_forward")
        libs.append((args.against, build("", source)))
    if args.classifier:
        return classifier_rounds(args, libs)
    grid = [CPU_GRID[i] for i in args.shapes or []] + args.extra
    grid = grid or list(CPU_GRID)
    kernel_calls = bool(args.against or args.kernel)
    modes = (("kernel forward", "kernel forward with grad_x") if kernel_calls
             else ("forward", "forward+backward"))
    lines = []
    say(lines, run_header(args.threads)
        + (f" | the kernel's calls, against {args.against}" if args.against else
           " | the kernel's calls" if args.kernel else "")
        + (" | with the gather limit" if args.gather else ""))
    results, gather = {}, {}  # gather: shape -> the gather limit's ms per round
    for r in range(args.rounds):
        for (B, K, D, N, dt) in grid:
            emb, labels, centres, cl, nb, w, sigma = make_inputs(B, K, D, N, DTYPES[dt], dev)
            x = emb.clone().requires_grad_(True)
            gb = gathered_bytes(B, K, D, DTYPES[dt]) / 1e6

            def fwd():
                nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, w, sigma)

            def fwd_bwd():
                x.grad = None
                nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, w, sigma).backward()

            def kernel(grad_x):
                return lambda: cpu.forward(emb, labels, centres, cl, nb, w, sigma,
                                           store_dist=False, need_grad_x=grad_x)

            calls = (kernel(False), kernel(True)) if kernel_calls else (fwd, fwd_bwd)
            if args.gather:
                use(libs[0][1])
                ms = time_ms(lambda: cpu.gather_read(centres, nb), dev, iters=args.iters)
                gather.setdefault((B, K, D, dt), []).append(ms)
                say(lines, f"round {r} | {GATHER} | {B},{K},{D},{dt} | read {ms:.3f} ms "
                           f"({gb / ms:.1f} GB/s)")
            for name, lib in in_turn(libs, r):
                use(lib)
                with nnkloss.value_checks(False):
                    ms = [time_ms(f, dev, iters=args.iters) for f in calls]
                results.setdefault((name, (B, K, D, dt)), []).append(ms)
                say(lines, f"round {r} | {name} | {B},{K},{D},{dt} | {modes[0]} {ms[0]:.3f} "
                           f"ms ({gb / ms[0]:.1f} GB/s) | {modes[1]} {ms[1]:.3f} ms "
                           f"({gb / ms[1]:.1f} GB/s)")
    lines.append("# medians over the rounds")
    for shape, runs in gather.items():
        say(lines, f"{GATHER} | {','.join(map(str, shape))} | read "
                   f"{statistics.median(runs):.3f} ms")
    for (name, shape), runs in results.items():
        f, fb = (statistics.median(m[i] for m in runs) for i in (0, 1))
        pct = ""
        if shape in gather:
            gm = statistics.median(gather[shape])
            pct = f" | {100 * gm / f:.0f}% and {100 * gm / fb:.0f}% of the gather limit"
        say(lines, f"{name} | {','.join(map(str, shape))} | {modes[0]} {f:.3f} ms | "
                   f"{modes[1]} {fb:.3f} ms{pct}")
    append_log(args.out, lines)
    results.update(((GATHER, shape), [[ms, ms] for ms in runs]) for shape, runs in gather.items())
    return results


if __name__ == "__main__":
    main()
