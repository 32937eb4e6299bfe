"""Compile the Triton kernels (kernels/) for CUDA targets without a GPU; inspect the binaries.

A developer tool, shared by the build gate (tests/test_kernels_build_gate.py) and the static
report (benchmarks/kernel_report.py). Nothing here runs a kernel.

How: Triton decides between its interpreter and the compiler when ``@triton.jit`` decorates a
function (``TRITON_INTERPRET`` read at decoration), and the test process has it set. So the
builds run in a child process (``python static_build.py --child``) with TRITON_INTERPRET=0, a
stand-in active driver whose ``get_current_target()`` is ``GPUTarget("cuda", arch, 32)`` (the
"device" it reports is the arch number, so every target gets its own ``device_caches`` entry),
and ``JITFunction.run`` forced to ``warmup=True`` (compile, never launch). The real launchers
are called on CPU tensors; each launch's compiled kernel (cubin) is inspected with
``cuobjdump -res-usage`` and ``nvdisasm`` from Triton's own NVIDIA tool directory.

Each build is identified by Triton's kernel hash (the specialisation actually compiled), so
cases that map to the same binary are reported once (``duplicate_of``).
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per-SM limits (CUDA occupancy calculator): registers, threads, blocks, shared memory (KiB,
# usable per SM; 1 KiB per block is reserved by the driver on sm_80+).
LIMITS = {
    80: dict(regs=65536, threads=2048, blocks=32, smem_kib=164, warps=64),
    90: dict(regs=65536, threads=2048, blocks=32, smem_kib=228, warps=64),
    100: dict(regs=65536, threads=2048, blocks=32, smem_kib=228, warps=64),
}
REG_ALLOC_UNIT = 256       # registers are allocated per warp in units of 256
# The register file is split over the SM's 4 sub-partitions (one per warp scheduler), each
# holding whole warps: the warps that fit are 4 x (16K registers // a warp's registers), not
# 64K // a warp's registers (cuda_occupancy.h, cudaOccMaxBlocksPerSMRegsLimit and
# cudaOccSubPartitionsPerMultiprocessor: 4 on sm_70 and later). At 104 registers a thread
# (3328 a warp) that is 16 warps, not 19.
REG_SUB_PARTITIONS = 4
MAX_REGS_PER_THREAD = 255
RESERVED_SMEM_PER_BLOCK = 1024
# A block's shared memory (its own plus the reserved 1 KiB) is allocated in units of 128 bytes
# on sm_80 and later (cudaOccSMemAllocationGranularity).
SMEM_ALLOC_UNIT = 128
MIN_RESIDENT_WARPS = 16    # the gate's floor

DTYPE_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class Build:
    """One launcher call: kernel 'fwd' (neighbour_kernel_fwd), 'centre_grad', 'rel_sqdist'
    (the classifier's distances; ``emb`` is the query dtype, fp64 queries compute in fp64),
    'gathered_finite' (the value check of the gathered centres; K list entries a row) or
    'scale_rows' (the backward's embedding gradient: ``bank`` is grad_x's dtype, ``emb`` the
    output's, ``mean`` a mean's gradient: one g over a divisor; K unused) or 'entry_grads'
    (the backward's per-entry terms: ``bank`` is the compute dtype of the saved distances,
    every term asked for; D unused) or 'batch_lists' (a
    batch's lists from the bank's table, own index excluded: ``bank`` and ``idx`` are the
    table's dtype, K its width; D unused)."""
    kernel: str
    K: int
    D: int
    bank: str = "fp32"
    emb: str = "fp32"
    weights: bool = True
    idx: str = "int64"
    store_dist: bool = True
    B: int = 8
    # False: the forward-only build (GRAD_X=False, need_grad_x=False in the launcher).
    grad_x: bool = True
    # Explicit (block_k, block_d, num_warps, rows) of the forward; () = default_config.
    cfg: tuple = ()
    # A GPU's SM count for default_config's small-batch rule (with B as the batch); None: the
    # rule for a batch that fills the GPU.
    sms: Optional[int] = None
    # FwdConfig.prefetch_index (the next tile's list entries loaded during each tile).
    prefetch: bool = False
    # The forward's query and centre label dtypes.
    lab: str = "int64"
    clab: str = "int64"
    # The forward's counted mean (the launcher's mean: MEAN); scale_rows' divisor (DIVIDE).
    mean: bool = False

    @property
    def name(self) -> str:
        if self.kernel in ("centre_grad", "rel_sqdist"):
            return f"{self.kernel}-K{self.K}-D{self.D}-{self.bank}-{self.emb}-{self.idx}"
        if self.kernel == "gathered_finite":
            return f"{self.kernel}-K{self.K}-D{self.D}-{self.bank}-{self.idx}"
        if self.kernel == "scale_rows":
            return f"{self.kernel}-D{self.D}-{self.bank}-{self.emb}{'-mean' if self.mean else ''}"
        if self.kernel == "batch_lists":
            return f"{self.kernel}-K{self.K}-{self.idx}"
        if self.kernel == "entry_grads":
            return (f"{self.kernel}-K{self.K}-{self.bank}-{'w' if self.weights else 'now'}"
                    f"-{self.idx}")
        tail = "-cfg{}x{}w{}r{}".format(*self.cfg) if self.cfg else ""
        tail += f"-B{self.B}sms{self.sms}" if self.sms else ""
        tail += "" if self.grad_x else "-fwdonly"
        tail += "-pf" if self.prefetch else ""
        tail += "-mean" if self.mean else ""
        return (f"fwd-K{self.K}-D{self.D}-{self.bank}-{self.emb}-{'w' if self.weights else 'now'}"
                f"-{self.idx}-l{self.lab[3:]}c{self.clab[3:]}"
                f"-{'dist' if self.store_dist else 'nodist'}{tail}")


# The forward's launch axes: what neighbour_kernel_fwd specialises its build on besides the
# tile (dtypes of its pointers, HAS_W, ROW_ALIGN as bytes of a centre row's alignment, MEAN:
# reduction "mean" on every path).
# (The axes' order and the alignments' order are the greedy's: the one giving the fewest builds.)
FWD_AXES = dict(align=[2, 4, 8, 16], emb=["fp32", "bf16", "fp16", "fp64"],
                bank=["fp32", "bf16", "fp16", "fp64"], weights=[True, False],
                idx=["int32", "int64"], clab=["int32", "int64"], mean=[True, False])
# Its paths: (single pass, grad_x), with the D of each (a multiple of 16 elements, so every
# row alignment is D plus a few elements) and the list widths cycled through.
FWD_PATHS = {(True, True): ([128, 512, 64, 2048, 256, 1024], [100, 32, 256, 1000, 7]),
             (True, False): ([512, 128, 1024, 64, 2048, 256], [100, 256, 32, 7, 1000]),
             (False, True): ([5008, 4608], [100, 32, 7]),
             (False, False): ([4608, 5008], [100, 7, 32])}


def feasible(values: Dict) -> bool:
    """A row is aligned to at least its own element (an fp64 row to 8 bytes)."""
    return "align" not in values or "bank" not in values or \
        values["align"] >= DTYPE_SIZES[values["bank"]]


def pairwise(axes: Dict[str, list]) -> List[Dict]:
    """A small set of value combinations in which every feasible pair of values of any two
    axes appears (greedy: each step takes the combination covering most uncovered pairs)."""
    names = list(axes)

    def pairs(combo):
        return {((a, combo[a]), (b, combo[b])) for i, a in enumerate(names)
                for b in names[i + 1:]}
    combos = [c for c in (dict(zip(names, v)) for v in itertools.product(*axes.values()))
              if feasible(c)]
    todo = set().union(*(pairs(c) for c in combos))
    out = []
    while todo:
        best = max(combos, key=lambda c: len(pairs(c) & todo))
        out.append(best)
        todo -= pairs(best)
    return out


def aligned_d(base: int, bank: str, align: int) -> int:
    """A D past ``base`` (a multiple of 16) whose rows of ``bank`` are ``align`` bytes aligned."""
    return base + (0 if align == 16 else align // DTYPE_SIZES[bank])


def _covering_set() -> List[Build]:
    """The forward's axes pairwise on each of its paths, then the cases the gate needs in
    particular, then the other kernels' builds."""
    out = []
    for (single, grad_x), (bases, Ks) in FWD_PATHS.items():
        for i, c in enumerate(pairwise(FWD_AXES)):
            out.append(Build("fwd", Ks[i % len(Ks)], aligned_d(bases[i % len(bases)], c["bank"],
                                                                c["align"]),
                             c["bank"], c["emb"], c["weights"], c["idx"], i % 3 == 0,
                             grad_x=grad_x, lab=c["idx"], clab=c["clab"], mean=c["mean"]))
    # Tiles the rule gives in particular: a list of 1 (4 rows a program), a tiny one, the
    # measured shapes (2-byte banks at 2-4 KB rows, D 128 both banks, a production one).
    out.append(Build("fwd", 1, 1, "fp32", "fp32", True, "int32", True))
    out.append(Build("fwd", 3, 8, "fp16", "fp32", True, "int32", False, grad_x=False))
    for K, D, bank in [(100, 256, "bf16"), (100, 2048, "bf16"), (100, 128, "fp32"),
                       (100, 128, "bf16"), (256, 512, "bf16")]:
        out.append(Build("fwd", K, D, bank, "fp32", True, "int32", False))
    # The tiles a small batch lengthens to on a GPU (default_config with B and sms, an H100's
    # 132 SMs): the real-data protocol's lists of 1000 at D 64, and measured shapes; 64
    # elements a thread and 4 warps at B 128, 32 at B 600; fp64 computation's at B 128.
    for K, D, bank in [(1000, 64, "fp32"), (100, 128, "fp32"), (100, 512, "bf16")]:
        for B in (128, 600):
            out.append(Build("fwd", K, D, bank, "fp32", True, "int32", False, B=B, sms=132))
    for K, D, grad_x in [(1000, 64, True), (100, 128, False)]:
        out.append(Build("fwd", K, D, "fp64", "fp64", True, "int64", False, B=128, sms=132,
                         grad_x=grad_x))
    # The two-phase training call of 2-byte banks with weights and int64 lists that spilled
    # (with and without the mean: reduction "mean", the losses' default, launches MEAN), and
    # two-phase small batches (whose tiles once lengthened and spilled).
    for bank in ("bf16", "fp16"):
        for mean in (False, True):
            out.append(Build("fwd", 100, 5000, bank, "fp32", True, "int64", False, B=4,
                             mean=mean))
    for D, bank, grad_x in [(5000, "bf16", True), (4609, "fp32", False), (4609, "bf16", False)]:
        out.append(Build("fwd", 100, D, bank, "fp32", True, "int64", False, B=4, sms=132,
                         grad_x=grad_x))
    for D, bank in [(64, "fp32"), (1000, "bf16"), (5000, "fp32")]:
        out.append(Build("centre_grad", 32, D, bank, "fp32", idx="int32"))
    # The centre gradient in fp64 (fp64 embeddings: fp64 atomics and gradient).
    for K, D, bank in [(100, 64, "fp64"), (100, 128, "fp32"), (32, 1000, "fp64"),
                       (100, 128, "bf16"), (100, 128, "fp16")]:
        out.append(Build("centre_grad", K, D, bank, "fp64", idx="int64"))
    out.append(Build("centre_grad", 100, 128, "fp64", "fp32", idx="int64"))
    # The centre gradient's register-heaviest builds (found by a sweep of D <= 256 x bank x
    # index width x K): 130-168 registers and 12 warps per SM with 4096-element tiles.
    for K, D, bank, idx in [(100, 64, "fp32", "int64"), (100, 64, "bf16", "int64"),
                            (100, 100, "fp16", "int64"), (100, 128, "bf16", "int64"),
                            (32, 128, "fp32", "int64"), (100, 128, "fp32", "int32"),
                            (32, 16, "fp32", "int64")]:
        out.append(Build("centre_grad", K, D, bank, "fp32", idx=idx))
    # The classifier's distances: lists of k ~ 1000 at small D (the Fashion-MNIST protocol),
    # several D chunks, 2-byte banks, fp64 queries (fp64 arithmetic), an unaligned D.
    for K, D, bank, emb, idx in [(1000, 64, "fp32", "fp32", "int64"),
                                 (1000, 128, "bf16", "fp32", "int64"),
                                 (100, 512, "fp16", "bf16", "int32"),
                                 (30, 1000, "fp32", "fp32", "int64"),
                                 (1000, 64, "fp64", "fp64", "int64"),
                                 (7, 13, "fp32", "fp32", "int64")]:
        out.append(Build("rel_sqdist", K, D, bank, emb, idx=idx))
    # The value check of the gathered centres: every bank dtype, several D chunks, unaligned D.
    for K, D, bank, idx in [(32, 128, "fp32", "int32"), (100, 512, "bf16", "int64"),
                            (256, 2048, "fp16", "int32"), (100, 64, "fp64", "int64"),
                            (7, 13, "fp32", "int64")]:
        out.append(Build("gathered_finite", K, D, bank, "fp32", idx=idx))
    # The backward's embedding gradient: fp32 / fp64 grad_x, output in the embeddings' dtype,
    # one and several column blocks, an unaligned D; a mean's gradient (DIVIDE: one g over
    # the divisor) in both grad_x dtypes.
    for D, gx, emb, mean in [(64, "fp32", "fp32", False), (512, "fp32", "bf16", False),
                             (2048, "fp64", "fp64", False), (13, "fp32", "fp16", False),
                             (512, "fp32", "bf16", True), (2048, "fp64", "fp64", True)]:
        out.append(Build("scale_rows", 1, D, gx, emb, mean=mean))
    # The backward's per-entry terms: one tile and several, fp32 and fp64, with and without
    # weights, both list widths.
    for K, cdt, w, idx in [(100, "fp32", True, "int32"), (1000, "fp32", False, "int64"),
                           (7, "fp64", True, "int64")]:
        out.append(Build("entry_grads", K, 1, cdt, "fp32", weights=w, idx=idx))
    # A batch's lists: one chunk of a tile and several (K 1000), both table widths, a ragged K.
    # Built with the exclusion (the module's default; without it, a where less).
    for K, idx in [(100, "int32"), (1000, "int64"), (7, "int32")]:
        out.append(Build("batch_lists", K, 1, idx, "fp32", idx=idx))
    seen, uniq = set(), []
    for b in out:
        if b not in seen:
            seen.add(b)
            uniq.append(b)
    return uniq


BUILDS: List[Build] = _covering_set()


def sweep_builds() -> List[Build]:
    """Launch configurations around the default for a few production shapes (the report's
    evidence for default_config): single-pass tiles of 1024..16384 elements x 4/8/16 warps,
    plus rows per program for a tiny row."""
    out = []
    for K, D, bank in [(100, 128, "fp32"), (100, 128, "bf16"), (100, 512, "fp32"),
                       (100, 512, "bf16"), (100, 1000, "fp32"), (256, 2048, "bf16"),
                       (100, 4096, "fp32")]:
        bd = 1 << max(0, (D - 1).bit_length())
        for tile in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
            bk = tile // bd
            if bk < 1:
                continue
            # 1-2 warps: the warps split only the columns at D <= 512, so no reduction over the
            # list's axis crosses a warp (see default_config).
            for nw in (1, 2, 4, 8, 16):
                if tile // (32 * nw) > 256 or tile < 32 * nw:
                    continue
                out.append(Build("fwd", K, D, bank, "fp32", True, "int32", False,
                                 cfg=(bk, bd, nw, 1)))
    for rows in (1, 2, 4, 8):
        for nw in (1, 2, 4):
            out.append(Build("fwd", 32, 16, "fp32", "fp32", True, "int32", False,
                             cfg=(32, 16, nw, rows)))
    # The small-batch rule's lengthened tiles (B 128 on 132 SMs: 64 elements a thread at 4
    # warps) at 2, 4 and 8 warps, training and forward-only: the same tile at 8 warps holds 32
    # elements a thread, the register count that decides whether the B 128 builds keep 16
    # warps per SM (the gate's floor) with the same tiles and bytes in flight.
    for K, D, bank, bk in [(1000, 64, "fp32", 128), (100, 128, "fp32", 64),
                           (100, 512, "bf16", 16)]:
        for nw in (2, 4, 8):
            for grad_x in (True, False):
                out.append(Build("fwd", K, D, bank, "fp32", True, "int32", False,
                                 cfg=(bk, D, nw, 1), grad_x=grad_x))
    # The default builds of the GPU's measured shapes with the next tile's list entries
    # prefetched (FwdConfig.prefetch_index): B 4096 at D 128 (fp32, bf16) and D 512, and the
    # small batch's lengthened tiles, training and forward-only.
    for K, D, bank, B, sms in [(100, 128, "fp32", 8, None), (100, 128, "bf16", 8, None),
                               (100, 512, "fp32", 8, None), (1000, 64, "fp32", 128, 132),
                               (100, 128, "fp32", 128, 132)]:
        for grad_x in (True, False):
            out.append(Build("fwd", K, D, bank, "fp32", True, "int32", False, B=B, sms=sms,
                             grad_x=grad_x, prefetch=True))
    return out


def find_build(name: str) -> Build:
    for b in itertools.chain(BUILDS, sweep_builds()):
        if b.name == name:
            return b
    raise KeyError(name)


def tool_dir() -> Optional[str]:
    """Triton's bundled NVIDIA tools (cuobjdump, nvdisasm, ptxas), None when absent."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("triton")
    except Exception:
        return None
    if spec is None or not spec.origin:
        return None
    d = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin")
    ok = all(os.path.exists(os.path.join(d, t)) for t in ("cuobjdump", "nvdisasm", "ptxas"))
    return d if ok else None


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(arch: int, regs: int, smem_bytes: int, num_warps: int) -> Dict[str, int]:
    """Resident blocks and warps per SM from registers/thread, shared memory and warps, as the
    CUDA occupancy calculator computes them (cuda_occupancy.h: cudaOccMaxBlocksPerSMRegsLimit,
    cudaOccMaxBlocksPerSMSmemLimit)."""
    lim = LIMITS[arch]
    warp_regs = _round_up(max(regs, 1) * 32, REG_ALLOC_UNIT)
    # The hardware's check that a block fits at all rounds its warps up to the sub-partitions.
    fits = (regs <= MAX_REGS_PER_THREAD
            and warp_regs * _round_up(num_warps, REG_SUB_PARTITIONS) <= lim["regs"])
    per_partition = (lim["regs"] // REG_SUB_PARTITIONS) // warp_regs
    by_regs = per_partition * REG_SUB_PARTITIONS // num_warps if fits else 0
    by_threads = lim["threads"] // (32 * num_warps)
    smem = _round_up(smem_bytes + RESERVED_SMEM_PER_BLOCK, SMEM_ALLOC_UNIT)
    by_smem = (lim["smem_kib"] * 1024) // smem
    blocks = min(by_regs, by_threads, lim["blocks"], by_smem)
    limiter = min(("regs", by_regs), ("threads", by_threads), ("blocks", lim["blocks"]),
                  ("smem", by_smem), key=lambda t: t[1])[0]
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * num_warps, limiter=limiter)


def min_resident_warps(entry: Dict) -> int:
    """The gate's floor of resident warps per SM for one built entry: MIN_RESIDENT_WARPS, or
    for a small batch's build (``B`` and ``sms`` given) the warps its own launch places on the
    busiest SM, where fewer. Such a launch never fills an SM, so registers cannot cost it
    resident warps: the small-batch rule's 64-element tiles at 4 warps take ~160 registers,
    12 resident warps per SM on sm_80/90, against the 4 that B 128 places on an SM of 132."""
    b, cfg = entry["build"], entry.get("config")
    if not b.get("sms") or not cfg:
        return MIN_RESIDENT_WARPS
    programs = -(-b["B"] // cfg["rows"])
    return min(MIN_RESIDENT_WARPS, -(-programs // b["sms"]) * cfg["num_warps"])


def bytes_per_row(b: Build, block_d: int = 0, single_pass: bool = True, tile_k: int = 1) -> int:
    """Bytes one query row must move: gathered centre rows, the list entry, the centre label
    (stored by the bank with the lists' width), the weight, the embedding and label read;
    grad_x (not in the forward-only build), loss and two lse's written; dist only when stored.
    The two-phase path (D > register tile) with grad_x reads the centres and metadata twice
    and always writes and re-reads dist (scratch)."""
    e, x, i = DTYPE_SIZES[b.bank], DTYPE_SIZES[b.emb], DTYPE_SIZES[b.idx]
    clab = i  # a CentreBank stores centre labels with its lists' width (int32 below 2**31)
    meta = i + clab + (4 if b.weights else 0)
    if b.kernel == "centre_grad":
        return b.K * (b.D * e + i + 4 + b.D * 4 * 2) + b.D * x
    if b.kernel == "gathered_finite":  # a row's listed centres and their entries
        return b.K * (b.D * e + i)
    if b.kernel == "scale_rows":  # grad_x read, the gradient written; g and lse_pos
        return b.D * (e + x) + 2 * e
    if b.kernel == "batch_lists":  # the table's row read and the list written; idx and label
        return 2 * b.K * i + 16 + i  # (int64 from a loader) and the bank row's label read
    if b.kernel == "entry_grads":  # two passes over the list's metadata; coef and q written
        return 2 * b.K * (e + i + clab + (4 if b.weights else 0)) + 2 * b.K * e + 4 * e
    if b.kernel == "rel_sqdist":  # x and the reference row once per tile of the list
        tiles = -(-b.K // max(1, tile_k))
        return b.K * (b.D * e + i + (8 if b.emb == "fp64" else 4)) + tiles * (b.D * (x + e) + i)
    reads = b.K * (b.D * e + meta) + b.D * x + 8
    writes = (b.D * 4 if b.grad_x else 0) + 3 * 4
    if single_pass or not b.grad_x:  # forward only: one phase whatever D
        writes += b.K * 4 if b.store_dist else 0
    else:
        reads += b.K * (b.D * e + meta) + b.D * x + b.K * 4
        writes += b.K * 4
    return reads + writes


def parse_res_usage(text: str) -> Dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the one function in ``cuobjdump -res-usage`` output.
    A format this does not read, or other than one function, is an error: a field read as 0
    would pass the gate (0 registers, 0 spilled bytes) without a look at the binary."""
    funcs = re.findall(r"^\s*Function\s+(\S+):\s*\n\s*(.*)$", text, flags=re.M)
    if len(funcs) != 1:
        raise ValueError(f"cuobjdump -res-usage: expected one function, found {len(funcs)}:\n"
                         f"{text[:1000]}")
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", funcs[0][1]))
    missing = {"REG", "STACK", "SHARED", "LOCAL"} - set(fields)
    if missing:
        raise ValueError(f"cuobjdump -res-usage: no {sorted(missing)} in {funcs[0][1]!r}")
    return {k: int(v) for k, v in fields.items()}


def spill_free(entry: Dict) -> bool:
    """No register spill: every spill is an STL (store) and an LDL (load) in the SASS, both
    counted, and no local memory. A spill's bytes are in cuobjdump's STACK (the stack frame),
    not LOCAL, which stays 0 with hundreds of bytes spilled; STACK is not a spill by itself
    (a stack frame also holds locals: the sm_90 gathered_finite build at D 128 fp32 keeps
    8 bytes there, written and read with generic ST / LD, no STL), so the gate checks it
    separately (KNOWN_STACK_FRAMES)."""
    return entry["local"] == 0 and entry["spill_stores"] == 0 and entry["spill_loads"] == 0


# Builds with a stack frame but no spill, by (arch, build name): bytes. Any other stack frame
# fails the gate, so that a spill the SASS counts missed would not pass unseen.
KNOWN_STACK_FRAMES = {
    # 8 bytes: two flag bytes stored and read back as one 16-bit word (ST.E.U8 x 2, LD.E.U16
    # through the stack's generic address), once per program after the loop over D.
    (90, "gathered_finite-K32-D128-fp32-int32"): 8,
    (100, "gathered_finite-K32-D128-fp32-int32"): 8,
}


def _inspect(cubin: bytes, tools: str, workdir: str, tag: str) -> Dict:
    path = os.path.join(workdir, re.sub(r"[^A-Za-z0-9_.-]", "_", tag) + ".cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path],
                         capture_output=True, text=True, check=True).stdout
    fields = parse_res_usage(res)
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path],
                          capture_output=True, text=True, check=True).stdout
    # Instructions are counted below; a disassembly without any ("/*0000*/ ... ;" lines) would
    # count no spill store and no load, and pass.
    if not re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", sass):
        raise ValueError(f"nvdisasm -c: no instructions in its output:\n{sass[:1000]}")
    loads = re.findall(r"\bLDG\.E((?:\.\w+)*)", sass)
    widths = {"128": 0, "64": 0, "32": 0, "16": 0, "8": 0}
    for suffix in loads:
        parts = suffix.split(".")
        if "128" in parts:
            widths["128"] += 1
        elif "64" in parts:
            widths["64"] += 1
        elif "U16" in parts or "S16" in parts:
            widths["16"] += 1
        elif "U8" in parts or "S8" in parts:
            widths["8"] += 1
        else:
            widths["32"] += 1
    return dict(regs=fields["REG"], stack=fields["STACK"], static_smem=fields["SHARED"],
                local=fields["LOCAL"],
                spill_stores=len(re.findall(r"\bSTL\b", sass)),
                spill_loads=len(re.findall(r"\bLDL\b", sass)),
                # Cross-warp traffic: every barrier and shared-memory access in the binary (a
                # reduction over an axis that spans warps goes through shared memory between
                # two barriers; one inside the list loop is paid on every tile).
                bar_syncs=len(re.findall(r"\bBAR\.SYNC", sass)),
                smem_ops=len(re.findall(r"\b(?:LDS|STS)\b", sass)),
                ldg=widths, sass_lines=sass.count("\n"))


# ------------------------------------------------------------------------------------------
# Child process: the actual compiles
# ------------------------------------------------------------------------------------------

def _child(archs: List[int], names: List[str], workdir: str) -> Dict:
    import torch
    import triton
    from triton.backends import DriverBase
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    assert not triton.knobs.runtime.interpret, "the child must run with TRITON_INTERPRET=0"

    class StandInDriver(DriverBase):
        """Active driver for a GPU that is not there: a target, a device id, a stream."""

        def __init__(self, arch):
            self.arch = arch

        @classmethod
        def is_active(cls):
            return False

        def get_current_target(self):
            return GPUTarget("cuda", self.arch, 32)

        def get_current_device(self):
            return self.arch  # one device_caches entry per target

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise RuntimeError("no benchmarking without a GPU")

        def map_python_to_cpp_type(self, ty):  # only used by launchers, never reached here
            raise RuntimeError(f"the stand-in driver launches nothing (asked to map {ty})")

    compiled = []
    orig_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self, k))
        return k

    JITFunction.run = compile_only
    # kernels/ imported as the plain package it is (nothing of nnkloss is needed to compile);
    # its modules by name, since the package's own names are their functions.
    sys.path.insert(0, ROOT)
    nk, rs, gf, sr, eg, bl = (importlib.import_module(f"kernels.{m}") for m in (
        "neighbour_kernel", "relative_distances", "gathered_finite", "scale_rows", "entry_grads",
        "batch_lists"))
    tdtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               "fp64": torch.float64, "int32": torch.int32, "int64": torch.int64}
    tools = tool_dir()
    out = {"triton": triton.__version__, "archs": {}, "tools": tools}
    for arch in archs:
        triton.runtime.driver.set_active(StandInDriver(arch))
        rows, seen = {}, {}
        t_arch = time.time()
        for name in names:
            b = find_build(name)
            g = torch.Generator().manual_seed(0)
            N = 4
            emb = torch.randn(b.B, b.D, generator=g).to(tdtypes[b.emb])
            cen = torch.randn(N, b.D, generator=g).to(tdtypes[b.bank])
            nb = torch.randint(0, N, (b.B, b.K), generator=g).to(tdtypes[b.idx])
            compiled.clear()
            t0 = time.time()
            entry = dict(build=asdict(b))
            try:
                if b.kernel == "fwd":
                    lab = torch.zeros(b.B, dtype=tdtypes[b.lab])
                    cl = torch.zeros(N, dtype=tdtypes[b.clab])
                    w = torch.ones(N) if b.weights else None
                    cfg = (nk.FwdConfig(b.cfg[0], b.cfg[1], b.cfg[2], 2, b.cfg[3]) if b.cfg
                           else nk.default_config(b.K, b.D, elem_size=cen.element_size(),
                                                 grad_x=b.grad_x,
                                                 B=b.B if b.sms else None, sms=b.sms,
                                                 compute_size=emb.element_size()
                                                 if emb.dtype == torch.float64 else 4,
                                                 aligned=nk.row_align(b.D, cen)
                                                 * cen.element_size() >= 4))
                    cfg = dataclasses.replace(cfg, prefetch_index=b.prefetch)
                    nk.neighbour_kernel_fwd(emb, lab, cen, cl, nb, w, torch.tensor(1.0),
                                            config=cfg, store_dist=b.store_dist,
                                            need_grad_x=b.grad_x, mean=b.mean)
                    entry.update(config=asdict(cfg), single_pass=cfg.single_pass(b.D),
                                 tile_elems=cfg.block_k * cfg.block_d)
                    entry["bytes_per_row"] = bytes_per_row(b, cfg.block_d, cfg.single_pass(b.D))
                elif b.kernel == "gathered_finite":
                    gf.gathered_rows_finite(cen, nb)
                    be, bd = gf.gathered_finite_config(b.D)
                    entry.update(config=dict(block_k=be, block_d=bd, num_warps=4, num_stages=3,
                                             rows=1), single_pass=bd >= b.D, tile_elems=be * bd)
                    entry["bytes_per_row"] = bytes_per_row(b)
                elif b.kernel == "scale_rows":
                    gx = emb.to(tdtypes[b.bank])
                    # A mean's gradient: one g (0-dim) over the mean's divisor.
                    g_rows, div = (gx[0, 0], gx[0, 1]) if b.mean else (gx[:, 0], None)
                    sr.scale_rows(gx, g_rows, gx[:, 0].contiguous(), tdtypes[b.emb], div)
                    br, bd = sr.scale_rows_config(b.D)
                    entry.update(config=dict(block_k=br, block_d=bd, num_warps=4, num_stages=3,
                                             rows=br), single_pass=bd >= b.D, tile_elems=br * bd)
                    entry["bytes_per_row"] = bytes_per_row(b)
                elif b.kernel == "entry_grads":
                    cdt = tdtypes[b.bank]
                    u = torch.rand(b.B, b.K, generator=g).to(cdt)
                    lse = torch.zeros(b.B, dtype=cdt)
                    eg.entry_grads(u, torch.zeros(b.B, dtype=tdtypes[b.idx]),
                                   torch.zeros(N, dtype=tdtypes[b.idx]), nb,
                                   torch.ones(N) if b.weights else None, lse, lse,
                                   torch.ones(b.B, dtype=cdt), torch.tensor(1.0), True, True,
                                   True)
                    bk, nw = eg.entry_grads_config(b.K)
                    entry.update(config=dict(block_k=bk, block_d=1, num_warps=nw, num_stages=3,
                                             rows=1), single_pass=bk >= b.K, tile_elems=bk)
                    entry["bytes_per_row"] = bytes_per_row(b)
                elif b.kernel == "batch_lists":
                    table = torch.randint(0, N, (N, b.K), generator=g).to(tdtypes[b.idx])
                    batch = torch.zeros(b.B, dtype=torch.int64)
                    bl.batch_lists(table, batch, batch, torch.zeros(N, dtype=tdtypes[b.idx]),
                                   True)
                    bb, bk = bl.batch_lists_config(b.K)
                    entry.update(config=dict(block_k=bk, block_d=1, num_warps=4, num_stages=3,
                                             rows=bb), single_pass=bk >= b.K, tile_elems=bb * bk)
                    entry["bytes_per_row"] = bytes_per_row(b)
                elif b.kernel == "rel_sqdist":
                    cdt = torch.float64 if b.emb == "fp64" else torch.float32
                    rs.rel_sqdist(emb, cen, nb, nb[:, 0], cdt)
                    bk, bd = rs.rel_sqdist_config(b.K, b.D)
                    entry.update(config=dict(block_k=bk, block_d=bd, num_warps=4, num_stages=3,
                                             rows=1), single_pass=bd >= b.D, tile_elems=bk * bd)
                    entry["bytes_per_row"] = bytes_per_row(b, tile_k=bk)
                else:
                    coef = torch.randn(b.B, b.K, generator=g)
                    nk.centre_grad(emb, cen, nb, coef)
                    bk, bd = nk.centre_grad_config(b.K, b.D)
                    entry.update(config=dict(block_k=bk, block_d=bd, num_warps=4, num_stages=3,
                                             rows=1), single_pass=True, tile_elems=bk * bd)
                    entry["bytes_per_row"] = bytes_per_row(b)
                entry["row_align"] = nk.row_align(b.D, cen)
                (fn, k), = compiled
                entry["compile_s"] = round(time.time() - t0, 2)
                entry["hash"] = k.hash
                entry["duplicate_of"] = seen.get(k.hash)
                seen.setdefault(k.hash, name)
                md = k.metadata
                entry.update(kernel_name=md.name, num_warps=md.num_warps,
                             num_stages=md.num_stages, dyn_smem=md.shared, ok=True)
                if tools:
                    entry.update(_inspect(k.asm["cubin"], tools, workdir, f"{arch}-{name}"))
                    smem = entry["dyn_smem"] + entry["static_smem"]
                    entry.update(occupancy(arch, entry["regs"], smem, md.num_warps))
                    tile_bytes = entry["tile_elems"] * DTYPE_SIZES[b.bank]
                    entry["bytes_in_flight_per_sm"] = entry["blocks_per_sm"] * tile_bytes
            except Exception as exc:  # reported, and asserted on by the gate
                entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
            rows[name] = entry
        out["archs"][str(arch)] = dict(builds=rows, seconds=round(time.time() - t_arch, 1))
    return out


def arch_support(arch: int) -> Optional[str]:
    """None if this Triton can target sm_<arch> here, else the reason."""
    if tool_dir() is None:
        return "Triton's NVIDIA tools (cuobjdump/nvdisasm/ptxas) are not installed"
    if arch not in LIMITS:
        return f"no occupancy limits recorded for sm_{arch}"
    if arch >= 100 and not os.path.exists(os.path.join(tool_dir(), "ptxas-blackwell")):
        return f"this Triton has no ptxas for sm_{arch}"
    return None


def compile_builds(archs, names=None, timeout=600, cache_dir=None) -> Dict:
    """Run the child once for all targets; returns its JSON (see _child). ``cache_dir`` gives
    the child its own TRITON_CACHE_DIR (a cold build when the directory is new)."""
    names = list(names) if names is not None else [b.name for b in BUILDS]
    env = dict(os.environ, TRITON_INTERPRET="0")
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
    t0, cpu0 = time.time(), _children_cpu()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", "--archs",
         *map(str, archs), "--names", *names],
        capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"static build child failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # CPU seconds (the child and its tools): the gate's cost whatever else the machine runs.
    out.update(wall_s=round(time.time() - t0, 1), cpu_s=round(_children_cpu() - cpu0, 1))
    return out


def _children_cpu() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def all_archs():
    return [a for a in (80, 90, 100)]


def _main(argv=None):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--archs", type=int, nargs="+", default=[90])
    ap.add_argument("--names", nargs="+", default=[b.name for b in BUILDS])
    args = ap.parse_args(argv)
    if args.child:
        # The cubins are written for the tools to read, then removed with their directory
        # (before, every gate run left one nk_static_* directory of cubins in the temp dir).
        import tempfile
        with tempfile.TemporaryDirectory(prefix="nk_static_") as workdir:
            print(json.dumps(_child(args.archs, args.names, workdir)))
    else:
        print(json.dumps(compile_builds(args.archs, args.names), indent=1))


if __name__ == "__main__":
    _main()
