"""Static kernel report: the package's Triton kernels compiled for CUDA targets, no GPU needed.

    python benchmarks/kernel_report.py                      # sm_90 and sm_80, builds + sweep
    python benchmarks/kernel_report.py --archs 90 --no-sweep

Per kernel, target and configuration: registers/thread, spills (STL and LDL counts in the SASS;
a spill's bytes are in the stack frame, ``stack_bytes``: cuobjdump's LOCAL, ``local_bytes``, stays
0 for spills),
shared memory, warps, resident blocks and warps per SM (occupancy from the Hopper / Ampere
limits: 64K registers, 2048 threads, 32 blocks, 228 / 164 KiB shared per SM), the limiter,
barriers and shared-memory accesses in the binary (what a reduction across warps costs),
global-load widths in the SASS (LDG.E.128 / .64 / 32-bit counts), bytes one query row must move
(the model in static_build.bytes_per_row) and bytes in flight per SM (resident blocks x
one gathered centre tile). Rows go to ``benchmarks/results/static_sm_<arch>.csv`` (overwritten)
with the Triton version and the commit. The compile/inspect code is benchmarks/static_build.py,
shared with the build gate (tests/test_kernels_build_gate.py).

The "sweep" rows (configuration suffix ``-cfg<block_k>x<block_d>w<warps>r<rows>``) are the
static evidence for the launch rule (kernels/config.py; docs/PERFORMANCE.md, "The launch rule
and its evidence").
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import static_build  # noqa: E402
from common import git_commit  # noqa: E402
from nnkloss.atomic import atomic_write  # noqa: E402

COLUMNS = ["kernel", "build", "set", "K", "D", "bank", "emb", "weights", "idx", "lab", "clab",
           "store_dist", "grad_x", "prefetch", "block_k", "block_d", "num_warps", "num_stages",
           "rows", "single_pass", "row_align", "regs", "local_bytes", "stack_bytes",
           "spill_stores", "spill_loads", "static_smem", "dyn_smem", "blocks_per_sm",
           "warps_per_sm", "limiter", "bar_syncs", "smem_ops", "ldg128", "ldg64", "ldg32",
           "ldg16", "bytes_per_row", "bytes_in_flight_per_sm", "duplicate_of", "compile_s",
           "ok", "error", "target", "triton", "commit"]


def rows_for(arch_result, sets, arch, triton_version, commit):
    out = []
    for name, e in arch_result["builds"].items():
        b, cfg, ldg = e["build"], e.get("config", {}), e.get("ldg", {})
        out.append([
            e.get("kernel_name", b["kernel"]), name, sets.get(name, "gate"), b["K"], b["D"],
            b["bank"], b["emb"], int(b["weights"]), b["idx"], b.get("lab"), b.get("clab"),
            int(b["store_dist"]), int(b.get("grad_x", True)), int(b.get("prefetch", False)),
            cfg.get("block_k"), cfg.get("block_d"), e.get("num_warps"), e.get("num_stages"),
            cfg.get("rows"), int(bool(e.get("single_pass"))), e.get("row_align"), e.get("regs"),
            e.get("local"), e.get("stack"), e.get("spill_stores"), e.get("spill_loads"),
            e.get("static_smem"), e.get("dyn_smem"),
            e.get("blocks_per_sm"), e.get("warps_per_sm"), e.get("limiter"),
            e.get("bar_syncs"), e.get("smem_ops"), ldg.get("128"),
            ldg.get("64"), ldg.get("32"), ldg.get("16"), e.get("bytes_per_row"),
            e.get("bytes_in_flight_per_sm"), e.get("duplicate_of") or "", e.get("compile_s"),
            int(e["ok"]), e.get("error", ""), f"sm_{arch}", triton_version, commit])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--no-sweep", action="store_true", help="only the gate's covering set")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    archs = []
    for a in args.archs:
        why = static_build.arch_support(a)
        if why:
            print(f"sm_{a}: skipped ({why})")
        else:
            archs.append(a)
    if not archs:
        return []
    sets = {b.name: "gate" for b in static_build.BUILDS}
    if not args.no_sweep:
        sets.update({b.name: "sweep" for b in static_build.sweep_builds()})
    t0 = time.time()
    res = static_build.compile_builds(archs, list(sets), timeout=1800)
    commit = git_commit()
    os.makedirs(args.out, exist_ok=True)
    paths = []
    for a in archs:
        path = os.path.join(args.out, f"static_sm_{a}.csv")
        text = io.StringIO(newline="")
        w = csv.writer(text)
        w.writerow(COLUMNS)
        w.writerows(rows_for(res["archs"][str(a)], sets, a, res["triton"], commit))
        atomic_write(path, text.getvalue().encode())
        paths.append(path)
        print(f"sm_{a}: {len(sets)} builds in {res['archs'][str(a)]['seconds']} s -> {path}")
    print(f"triton {res['triton']} @ {commit}; total {time.time() - t0:.0f} s")
    return paths


if __name__ == "__main__":
    main()
