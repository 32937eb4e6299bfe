"""Build gate: every Triton kernel of the package, through its real launcher, compiled for
sm_80, sm_90 and sm_100 on a machine without a GPU, and its binary inspected.

The builds run once per session in a child process (benchmarks/static_build.py:
TRITON_INTERPRET=0, a stand-in active driver reporting GPUTarget("cuda", arch, 32), launches
turned into warmups). Asserted per build: it compiles; no spills (no STL or LDL, local memory 0:
static_build.spill_free) and no stack frame but the known ones; at least 16 resident warps per
SM, or for a small batch's build as many as its launch places on an SM
(static_build.min_resident_warps); 128-bit gathers (or the 64-bit form when the rows are only
8-byte aligned) wherever the launcher found the centre rows aligned. The forward's builds
cover its launch axes pairwise on each of its four paths (test_every_pair_...). A target this
Triton cannot build, or missing NVIDIA tools, is a clean skip.
"""
import dataclasses
import os
import shutil
import stat
import subprocess
import time

import sys

import pytest

from nnkloss.ops.backends import kernels as _kernels

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import kernel_report  # noqa: E402
import static_build as sb  # noqa: E402

ARCHS = [80, 90, 100]
NAMES = [b.name for b in sb.BUILDS]


@pytest.fixture(scope="session")
def gate():
    archs = [a for a in ARCHS if sb.arch_support(a) is None]
    if not archs:
        return {"archs": {}, "wall_s": 0.0, "cpu_s": 0.0}
    t0 = time.time()
    out = sb.compile_builds(archs, NAMES, timeout=900)
    out["wall_s"] = time.time() - t0
    return out


def _entry(gate, arch, name):
    why = sb.arch_support(arch)
    if why:
        pytest.skip(why)
    return gate["archs"][str(arch)]["builds"][name]


# Every parameter of the forward kernel, by what sets its build: a launch axis of the gate's
# pairwise set (static_build.FWD_AXES), the labels' dtype, the path, the tile, or nothing the
# build specialises on that the gate varies (outputs and sigma in the compute dtype, sizes).
# The mean's buffers are the outputs' dummies without MEAN, so they go with it.
_FWD_PARAMS = dict(
    emb_ptr="emb", COMPUTE="emb", cen_ptr="bank", nbr_ptr="idx", clab_ptr="clab",
    w_ptr="weights", HAS_W="weights", ROW_ALIGN="align", EMB_ALIGN="align", lab_ptr="labels",
    MEAN="mean", counted_ptr="mean", part_ptr="mean", part_n_ptr="mean", ticket_ptr="mean",
    mean_ptr="mean", divisor_ptr="mean",
    SINGLE_PASS="path", GRAD_X="path", STORE_DIST="tile", BLOCK_K="tile", BLOCK_D="tile",
    ROWS="tile", PREFETCH_INDEX="tile", sigma_ptr="fixed", loss_ptr="fixed",
    lse_all_ptr="fixed", lse_pos_ptr="fixed", gx_ptr="fixed", dist_ptr="fixed", B="fixed",
    K="fixed", D="fixed", N="fixed", stride_eb="fixed", stride_cn="fixed", stride_nb="fixed",
    stride_gb="fixed", stride_db="fixed")


def _fwd_axes(b):
    """(path, axis values) of a forward build, as the launcher derives them."""
    import torch
    nk = _kernels().neighbour_kernel
    cfg = nk.default_config(b.K, b.D, elem_size=sb.DTYPE_SIZES[b.bank], grad_x=b.grad_x,
                            B=b.B if b.sms else None, sms=b.sms,
                            compute_size=8 if b.emb == "fp64" else 4)
    bank = torch.empty(2, b.D, dtype=getattr(torch, _TORCH[b.bank]))
    values = dict(emb=b.emb, bank=b.bank, weights=b.weights, idx=b.idx, clab=b.clab,
                  align=nk.row_align(b.D, bank) * bank.element_size(), mean=b.mean)
    return (cfg.single_pass(b.D), b.grad_x), values


_TORCH = dict(fp16="float16", bf16="bfloat16", fp32="float32", fp64="float64")


def test_every_parameter_of_the_forward_kernel_is_an_axis_or_says_why_not():
    """A specialisation added to the forward kernel must be placed here: as a launch axis
    (then the gate's pairwise set covers it) or as something else."""
    import inspect
    fn = _kernels().neighbour_kernel._nk_fwd_kernel
    params = set(inspect.signature(getattr(fn, "fn", fn)).parameters)
    assert params == set(_FWD_PARAMS), (params ^ set(_FWD_PARAMS))
    axes = set(_FWD_PARAMS.values()) - {"labels", "path", "tile", "fixed"}
    assert axes == set(sb.FWD_AXES)


def test_the_axes_hold_every_value_the_launcher_takes():
    """Both float axes every float dtype, both list widths, weights or none, the mean or
    none, and every row alignment row_align gives (bytes; an fp64 row at least 8, an fp32 row
    at least 4)."""
    import torch
    nk = _kernels().neighbour_kernel
    assert set(sb.FWD_AXES["emb"]) == set(sb.FWD_AXES["bank"]) == set(_TORCH)
    assert set(sb.FWD_AXES["idx"]) == set(sb.FWD_AXES["clab"]) == {"int32", "int64"}
    assert set(sb.FWD_AXES["weights"]) == set(sb.FWD_AXES["mean"]) == {True, False}
    seen = {(name, nk.row_align(D, t) * t.element_size())
            for name, dt in _TORCH.items() for D in range(1, 65)
            for t in [torch.empty(3, D, dtype=getattr(torch, dt))]}
    assert {a for _, a in seen} == set(sb.FWD_AXES["align"])
    assert seen == {(bank, a) for bank in _TORCH for a in sb.FWD_AXES["align"]
                    if sb.feasible(dict(bank=bank, align=a))}


def test_every_pair_of_axis_values_is_built_on_every_path():
    """Issue 58: single pass and two-phase, training and forward-only, each builds every
    feasible pair of values of any two launch axes (a two-phase 2-byte bank with weights and
    int64 lists spilled, and no build had that combination)."""
    names = list(sb.FWD_AXES)
    want = {((a, va), (b, vb)) for i, a in enumerate(names) for b in names[i + 1:]
            for va in sb.FWD_AXES[a] for vb in sb.FWD_AXES[b]
            if sb.feasible({a: va, b: vb})}
    have, labels = {}, {}
    for b in sb.BUILDS:
        if b.kernel == "fwd" and not b.cfg:
            path, v = _fwd_axes(b)
            have.setdefault(path, set()).update(
                ((x, v[x]), (y, v[y])) for i, x in enumerate(names) for y in names[i + 1:])
            labels.setdefault(path, set()).add(b.lab)
    assert set(have) == {(True, True), (True, False), (False, True), (False, False)}
    for path, pairs in have.items():
        assert not want - pairs, (path, sorted(want - pairs))
        assert labels[path] == {"int32", "int64"}, path
    pairwise = [b for b in sb.BUILDS if b.kernel == "fwd" and not b.sms and not b.cfg]
    assert len(pairwise) <= 4 * 20 + 10, len(pairwise)  # a covering set, not the product


def test_the_two_phase_call_of_issue_58_is_built():
    """fp32 embeddings, a 2-byte bank, weights, int64 lists, D above the register tile;
    with the mean (the losses' default reduction) and without."""
    assert {(b.bank, b.mean) for b in sb.BUILDS if b.kernel == "fwd" and b.D > 4096
            and b.weights and b.idx == "int64" and b.emb == "fp32" and b.grad_x} >= \
        {(bank, mean) for bank in ("bf16", "fp16") for mean in (True, False)}


def test_the_mean_is_built_on_every_path_and_with_rows_per_program():
    """The op asks the forward for the mean (reduction "mean") whatever it computes: MEAN
    on each path, and where a program walks several rows (the rows past B left out of it)."""
    nk = _kernels().neighbour_kernel
    paths, rows = set(), set()
    for b in sb.BUILDS:
        if b.kernel == "fwd" and b.mean and not b.cfg:
            path, _ = _fwd_axes(b)
            paths.add(path)
            rows.add(nk.default_config(b.K, b.D, elem_size=sb.DTYPE_SIZES[b.bank],
                                       grad_x=b.grad_x, B=b.B if b.sms else None, sms=b.sms,
                                       compute_size=8 if b.emb == "fp64" else 4).rows)
    assert paths == {(True, True), (True, False), (False, True), (False, False)}
    assert rows >= {1, 4}, rows


def test_every_specialisation_of_scale_rows_is_built():
    """Its constexprs: the tile (BLOCK_R, BLOCK_D), lse_pos given (the op always gives it,
    as the builds do) and DIVIDE (a mean's gradient), built both ways."""
    import importlib
    import inspect
    fn = importlib.import_module("nnkloss.kernels.scale_rows")._scale_rows_kernel
    params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
    assert {p.name for p in params if "constexpr" in str(p.annotation)} == \
        {"HAS_LSE_POS", "DIVIDE", "BLOCK_R", "BLOCK_D"}
    built = {(b.bank, b.mean) for b in sb.BUILDS if b.kernel == "scale_rows"}
    assert built >= {(gx, mean) for gx in ("fp32", "fp64") for mean in (True, False)}, built


def test_centre_grad_builds_cover_its_heaviest_tiles():
    cg = [b for b in sb.BUILDS if b.kernel == "centre_grad"]
    # The centre gradient where it is heaviest (D <= 128, int64 lists, K 100) and elsewhere.
    assert any(b.D <= 128 and b.idx == "int64" and b.K >= 100 for b in cg)
    assert {b.bank for b in cg if b.D <= 128} >= {"fp32", "bf16", "fp16"}
    assert any(b.D > 256 for b in cg)


def test_small_batch_builds_take_the_lengthened_tiles():
    """The gate's small-batch builds go through default_config with B and an SM count (not
    written-out tiles), and that rule gives them longer tiles than the large batch's: at
    B 128 on 132 SMs 4 warps and 64 elements a thread, at B 600 the rule's warps and 32; on
    the two-phase path (B 4) the rule's own tiles."""
    nk = _kernels().neighbour_kernel
    small = [b for b in sb.BUILDS if b.sms]
    assert {b.B for b in small} == {4, 128, 600} and all(not b.cfg for b in small)
    lengthened = 0
    for b in small:
        kw = dict(elem_size=sb.DTYPE_SIZES[b.bank], grad_x=b.grad_x)
        cfg = nk.default_config(b.K, b.D, B=b.B, sms=b.sms, **kw)
        big = nk.default_config(b.K, b.D, **kw)
        if b.D > nk.MAX_SINGLE_PASS_BLOCK_D:
            assert cfg == big, b.name
            continue
        elems = (64 if b.B == 128 else 32) // (2 if b.bank == "fp64" else 1)  # 8-byte rows
        assert cfg.num_warps == (4 if b.B == 128 else big.num_warps), (b.name, cfg)
        assert cfg.block_k == max(big.block_k, elems * 32 * cfg.num_warps // cfg.block_d)
        lengthened += cfg.block_k > big.block_k
    assert lengthened >= 5, lengthened


def test_every_target_the_issue_names_is_gated():
    """sm_80 is checked as sm_90 is (issue 21: the centre gradient held 12 warps there)."""
    assert {80, 90} <= set(ARCHS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills_with_16_warps(gate, arch, name):
    """16 resident warps per SM, or for a small batch's build the warps its launch places on
    an SM (sb.min_resident_warps: it never fills one)."""
    e = _entry(gate, arch, name)
    assert e["ok"], e.get("error")
    assert sb.spill_free(e), (e["regs"], e["local"], e["spill_stores"], e["spill_loads"])
    # A stack frame without STL / LDL is no spill, but only the known ones pass: a spill the
    # instruction counts missed would show here.
    assert e["stack"] == sb.KNOWN_STACK_FRAMES.get((arch, name), 0), e["stack"]
    below = e["warps_per_sm"] < sb.min_resident_warps(e)
    assert not below, (e["regs"], e["num_warps"], e["limiter"])


@pytest.mark.parametrize("bank", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("grad_x", [True, False])
def test_fp64_embeddings_take_an_fp64_banks_tiles(bank, grad_x):
    """The registers hold the gathered values in the compute dtype: fp64 embeddings over a
    4- or 2-byte bank take the tiles of an fp64 bank (sized by the bank's bytes their training
    forwards fell below 16 warps per SM); fp32 embeddings keep the bank's rule."""
    nk = _kernels().neighbour_kernel
    for K, D, B, sms in ((100, 256, None, None), (100, 1024, None, None),
                         (100, 5000, None, None), (1000, 64, 128, 132), (100, 128, 600, 132)):
        size = sb.DTYPE_SIZES[bank]
        assert nk.default_config(K, D, elem_size=size, grad_x=grad_x, B=B, sms=sms,
                                 compute_size=8) == \
            nk.default_config(K, D, elem_size=8, grad_x=grad_x, B=B, sms=sms)
        assert nk.default_config(K, D, elem_size=size, grad_x=grad_x, B=B, sms=sms,
                                 compute_size=4) == \
            nk.default_config(K, D, elem_size=size, grad_x=grad_x, B=B, sms=sms)
    # fp32 computation keeps the bank's bytes: a 2-byte bank's 32 elements a thread (8 rows of
    # 128), an fp32 bank's 16 (4 rows); fp64's 8 (2 rows)
    C = nk.FwdConfig
    assert nk.default_config(100, 128, elem_size=2, grad_x=False, compute_size=4) == \
        C(8, 128, 1, 2, 1)
    assert nk.default_config(100, 128, elem_size=4, grad_x=False, compute_size=4) == \
        C(4, 128, 1, 2, 1)
    assert nk.default_config(100, 128, elem_size=2, grad_x=False, compute_size=8) == \
        C(2, 128, 1, 2, 1)


def test_only_small_batch_builds_have_a_lower_floor():
    """The floor is 16 but for builds made for a batch that cannot fill the GPU, whose floor
    is what their launch places on the busiest SM: 4 at B 128 on 132 SMs (one program of 4
    warps), 5 at B 600 (five one-warp programs), 8 for a two-phase forward-only B 4."""
    def entry(b):
        cfg = _kernels().neighbour_kernel.default_config(
            b.K, b.D, elem_size=sb.DTYPE_SIZES[b.bank], grad_x=b.grad_x,
            B=b.B if b.sms else None, sms=b.sms, compute_size=8 if b.emb == "fp64" else 4)
        return {"build": dataclasses.asdict(b), "config": dataclasses.asdict(cfg)}
    floors = {b.name: sb.min_resident_warps(entry(b)) for b in sb.BUILDS if b.kernel == "fwd"}
    low = {n: f for n, f in floors.items() if f < sb.MIN_RESIDENT_WARPS}
    assert low == {n: 4 if "B128sms132" in n else 5 if "B600" in n else 8 for n in low}, low
    assert all("sms" in n for n in low) and len(low) == 10, low
    assert sb.min_resident_warps({"build": {"kernel": "centre_grad"}}) == sb.MIN_RESIDENT_WARPS


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_rows_are_gathered_in_wide_loads(gate, arch, name):
    e = _entry(gate, arch, name)
    assert e["ok"], e.get("error")
    if e["build"]["kernel"] == "entry_grads":
        pytest.skip("no rows gathered: the per-entry terms read scalars of the list")
    if e["build"]["kernel"] == "batch_lists":
        pytest.skip("no centre rows gathered: the lists' rows are K entries, aligned as K is")
    esize = sb.DTYPE_SIZES[e["build"]["bank"]]
    width = e["row_align"] * esize  # bytes the launcher promised per row start
    if width < 8:
        pytest.skip(f"rows only {width}-byte aligned: the fallback build (scalar loads)")
    tile_bytes = e["tile_elems"] * esize
    per_thread = tile_bytes // (32 * e["num_warps"])
    # A thread's widest load is what the rows promise, or all it holds of the tile if less
    # (1 x 512 bf16 at 4 warps: 8 bytes a thread, one 64-bit load).
    widest = min(width, per_thread)
    if widest < 8:
        pytest.skip(f"{per_thread} bytes of the tile per thread: no wide load to make")
    want = max(1, per_thread // widest)
    key = "128" if widest == 16 else "64"
    assert e["ldg"][key] >= want, (key, e["ldg"], want)


def test_gate_duration(gate):
    """Its CPU time, which other work on the machine does not stretch as it does the wall."""
    print(f"build gate: {len(NAMES)} builds a target, {gate['wall_s']:.0f} s wall, "
          f"{gate['cpu_s']:.0f} s CPU, for targets {sorted(gate['archs'])}")
    assert gate["cpu_s"] < 400


# NVIDIA's own occupancy arithmetic (cuda_occupancy.h, shipped in Triton's wheel beside the
# tools the gate uses), compiled as a little program: one query a line, the resident blocks.
_OCC_CPP = r"""
#include <cstdio>
#include "cuda_occupancy.h"
int main() {
    int major, regs, smem, warps;
    while (scanf("%d %d %d %d", &major, &regs, &smem, &warps) == 4) {
        cudaOccDeviceProp p;
        p.computeMajor = major; p.computeMinor = 0;
        p.maxThreadsPerBlock = 1024; p.maxThreadsPerMultiprocessor = 2048;
        p.regsPerBlock = 65536; p.regsPerMultiprocessor = 65536; p.warpSize = 32;
        p.sharedMemPerBlock = 49152; p.numSms = 132; p.reservedSharedMemPerBlock = 1024;
        p.sharedMemPerMultiprocessor = major == 8 ? 167936 : 233472;  /* A100, H100 */
        p.sharedMemPerBlockOptin = major == 8 ? 166912 : 232448;
        cudaOccFuncAttributes a;
        a.maxThreadsPerBlock = 1024; a.numRegs = regs; a.sharedSizeBytes = 0;
        a.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;
        a.maxDynamicSharedSizeBytes = p.sharedMemPerBlockOptin;
        cudaOccDeviceState s;
        cudaOccResult r;
        cudaOccError e = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &p, &a, &s, warps * 32,
                                                                 smem);
        printf("%d\n", e == CUDA_OCC_SUCCESS ? r.activeBlocksPerMultiprocessor : -1);
    }
    return 0;
}
"""


def test_occupancy_rounds_registers_per_sub_partition():
    """Registers are allocated to warps within each of the SM's 4 sub-partitions (16K
    registers each), not from one 64K pool: 104 registers a thread (3328 a warp) keep
    4 x 4 = 16 one-warp blocks, not 65536 // 3328 = 19; and a block's shared memory is
    allocated in 128-byte units (45670 + 1 KiB reserved -> 46720 bytes: 4 blocks in 228 KiB,
    not 5). Before, warps per SM were over-stated for every build whose warp registers do not
    divide 16K (the report's 1-2 warp builds at 90-127 registers)."""
    assert sb.occupancy(80, 104, 0, 1)["warps_per_sm"] == 16
    assert sb.occupancy(90, 120, 0, 1)["warps_per_sm"] == 16
    assert sb.occupancy(90, 90, 0, 1)["warps_per_sm"] == 20
    assert sb.occupancy(90, 200, 0, 2)["warps_per_sm"] == 8
    assert sb.occupancy(90, 32, 45670, 1)["blocks_per_sm"] == 4
    assert sb.occupancy(90, 256, 0, 1)["blocks_per_sm"] == 0  # over 255 a thread: no launch


def test_occupancy_matches_cuda_occupancy_h(tmp_path):
    """sb.occupancy against NVIDIA's cuda_occupancy.h (compiled here) over every register
    count, block size and a spread of shared memory, for sm_80 and sm_90."""
    tools = sb.tool_dir()
    header = tools and os.path.join(os.path.dirname(tools), "include", "cuda_occupancy.h")
    cxx = shutil.which("g++") or shutil.which("c++")
    if not header or not os.path.exists(header) or not cxx:
        pytest.skip("needs Triton's cuda_occupancy.h and a C++ compiler")
    src = tmp_path / "occ.cpp"
    src.write_text(_OCC_CPP)
    exe = tmp_path / "occ"
    subprocess.run([cxx, "-O1", "-I", os.path.dirname(header), str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    cases = [(arch, regs, smem, warps) for arch in (80, 90) for regs in range(1, 256)
             for warps in (1, 2, 4, 8, 16, 32)
             for smem in (0, 100, 4096, 45670, 70000, 120000, 166912)]
    text = "".join(f"{arch // 10} {r} {s} {w}\n" for arch, r, s, w in cases)
    got = subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                         check=True).stdout.split()
    assert len(got) == len(cases)
    wrong = [(c, int(g), sb.occupancy(c[0], c[1], c[2], c[3])["blocks_per_sm"])
             for c, g in zip(cases, got)
             if int(g) != sb.occupancy(c[0], c[1], c[2], c[3])["blocks_per_sm"]]
    assert not wrong, (len(wrong), wrong[:10])


# A kernel that must spill under a register cap: 64 values loaded, all live until their sum
# is known, then each scaled and stored back. With 16 registers ptxas spills ~600 bytes.
_SPILL_PTX = "\n".join(
    [".version 7.0", ".target sm_80", ".address_size 64",
     ".visible .entry spill(.param .u64 p)", "{", "  .reg .f32 f<64>;", "  .reg .f32 s;",
     "  .reg .u64 rd<2>;", "  ld.param.u64 rd0, [p];", "  cvta.to.global.u64 rd1, rd0;"]
    + [f"  ld.global.f32 f{i}, [rd1+{4 * i}];" for i in range(64)]
    + ["  mov.f32 s, f0;"] + [f"  add.f32 s, s, f{i};" for i in range(1, 64)]
    + [f"  mul.f32 f{i}, f{i}, s;" for i in range(64)]
    + [f"  st.global.f32 [rd1+{4 * i}], f{i};" for i in range(64)]
    + ["  ret;", "}", ""])


def _ptxas(tmp_path, maxreg):
    tools = sb.tool_dir()
    if tools is None:
        pytest.skip("Triton's NVIDIA tools are not installed")
    ptx = tmp_path / "spill.ptx"
    ptx.write_text(_SPILL_PTX)
    out = tmp_path / f"spill{maxreg}.cubin"
    subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_80", f"--maxrregcount={maxreg}",
                    str(ptx), "-o", str(out)], check=True, capture_output=True)
    return tools, out.read_bytes()


def test_a_spilling_kernel_is_caught(tmp_path):
    """ptxas puts spilled registers in the stack frame: cuobjdump reports STACK > 0 and
    LOCAL 0 for them, so 'local == 0' (the gate's check before, beside the STL count) never
    saw a spilled byte, and the report's local_bytes column is 0 for any spill. The spill is
    caught by its STL and by its LDL (each alone), and its bytes are in ``stack``; the same
    kernel with registers enough is spill-free and has no stack frame."""
    tools, cubin = _ptxas(tmp_path, 16)
    e = sb._inspect(cubin, tools, str(tmp_path), "spill16")
    assert e["local"] == 0  # why LOCAL cannot be the spill measure
    assert e["stack"] > 0 and e["spill_stores"] > 0 and e["spill_loads"] > 0, e
    assert not sb.spill_free(e)
    assert not sb.spill_free(dict(e, spill_stores=0))
    assert not sb.spill_free(dict(e, spill_loads=0))
    tools, cubin = _ptxas(tmp_path, 128)
    e = sb._inspect(cubin, tools, str(tmp_path), "spill128")
    assert sb.spill_free(e) and e["stack"] == 0, e


def _fake_tools(tmp_path, res_usage, sass):
    """A tool directory whose cuobjdump / nvdisasm print the given text."""
    d = tmp_path / "tools"
    d.mkdir()
    for name, text in (("cuobjdump", res_usage), ("nvdisasm", sass)):
        (d / f"{name}.txt").write_text(text)
        script = d / name
        script.write_text(f"#!/bin/sh\ncat '{d / name}.txt'\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(d)


_SASS = "        /*0000*/                   MOV R1, c[0x0][0x28] ;\n        /*0010*/ EXIT ;\n"


@pytest.mark.parametrize("res_usage", [
    "",  # nothing printed
    " Function k:\n  REGISTERS:40 STACK:0 SHARED:0 LOCAL:0\n",  # a renamed field
    " Function k:\n  REG:40 SHARED:0 LOCAL:0\n",  # STACK missing
    " Function a:\n  REG:40 STACK:0 SHARED:0 LOCAL:0\n"
    " Function b:\n  REG:200 STACK:64 SHARED:0 LOCAL:0\n",  # which one was built?
])
def test_unreadable_resource_usage_is_an_error(tmp_path, res_usage):
    """Before, a field the regular expression did not find read as 0 (0 registers: every
    warp resident; 0 stack and local bytes: no spill), so a changed cuobjdump format passed
    the gate silently; with two functions the last one's figures were taken."""
    tools = _fake_tools(tmp_path, res_usage, _SASS)
    with pytest.raises(ValueError, match="res-usage"):
        sb._inspect(b"\0", tools, str(tmp_path), "fake")


def test_a_disassembly_without_instructions_is_an_error(tmp_path):
    """An empty disassembly counts no STL and no LDL: a spill-free verdict on nothing."""
    tools = _fake_tools(tmp_path, " Function k:\n  REG:40 STACK:0 SHARED:0 LOCAL:0\n",
                        "nvdisasm warning : something\n")
    with pytest.raises(ValueError, match="no instructions"):
        sb._inspect(b"\0", tools, str(tmp_path), "fake")
    tools2 = _fake_tools(tmp_path / "ok", " Function k:\n  REG:40 STACK:0 SHARED:0 LOCAL:0\n",
                         _SASS) if (tmp_path / "ok").mkdir() is None else None
    assert sb._inspect(b"\0", tools2, str(tmp_path), "fake")["regs"] == 40


def test_report_rows_carry_the_spill_bytes():
    """The static report's CSV has a column per figure the gate reads: its spill bytes are
    the stack frame's (the local_bytes column was the only byte count, 0 for any spill), and
    the spill loads beside the stores."""
    report = kernel_report
    b = sb.Build("fwd", 100, 128)
    e = dict(build=dataclasses.asdict(b), ok=True, regs=24, stack=576, local=0,
             spill_stores=153, spill_loads=197, ldg={})
    row, = report.rows_for({"builds": {b.name: e}}, {}, 90, "3.8.0", "abc")
    got = dict(zip(report.COLUMNS, row))
    assert len(row) == len(report.COLUMNS)
    assert (got["stack_bytes"], got["spill_stores"], got["spill_loads"], got["local_bytes"]) \
        == (576, 153, 197, 0)


_FLOATS = ("fp16", "bf16", "fp32", "fp64")


def _fwd_mode(emb, bank, grad_x, single_pass):
    return ("fp64" if emb == "fp64" else "fp32", bank, grad_x, single_pass)


def test_every_dtype_and_mode_the_loss_launchers_take_is_built():
    """Enumerates what neighbour_kernel_fwd and centre_grad compile for: embeddings and bank
    of any float dtype (fp16/bf16/fp32/fp64: the op's contract), so the compute dtype (fp64
    for fp64 embeddings, else fp32) by every bank dtype, training and forward-only, single
    pass and two-phase (D above MAX_SINGLE_PASS_BLOCK_D); each such specialisation must be in
    the build set. Before, no fp64 computation of either kernel was built (no fp64 embeddings
    at all) and no fp64 bank: 20 of the 40 modes were never compiled."""
    nk = _kernels().neighbour_kernel
    want = set()
    for emb in _FLOATS:
        for bank in _FLOATS:
            for grad_x in (True, False):
                for D in (128, nk.MAX_SINGLE_PASS_BLOCK_D + 904):
                    cfg = nk.default_config(100, D, elem_size=sb.DTYPE_SIZES[bank],
                                            grad_x=grad_x,
                                            compute_size=8 if emb == "fp64" else 4)
                    want.add(("fwd",) + _fwd_mode(emb, bank, grad_x, cfg.single_pass(D)))
            want.add(("centre_grad", "fp64" if emb == "fp64" else "fp32", bank))
    have = set()
    for b in sb.BUILDS:
        if b.kernel == "fwd":
            cfg = (nk.FwdConfig(b.cfg[0], b.cfg[1], b.cfg[2], 2, b.cfg[3]) if b.cfg else
                   nk.default_config(b.K, b.D, elem_size=sb.DTYPE_SIZES[b.bank],
                                     grad_x=b.grad_x,
                                     compute_size=8 if b.emb == "fp64" else 4))
            have.add(("fwd",) + _fwd_mode(b.emb, b.bank, b.grad_x, cfg.single_pass(b.D)))
        elif b.kernel == "centre_grad":
            have.add(("centre_grad", "fp64" if b.emb == "fp64" else "fp32", b.bank))
    assert not want - have, sorted(want - have)


def test_the_child_leaves_no_cubins_behind(tmp_path, monkeypatch):
    """Each gate run wrote its cubins to a fresh nk_static_* directory and left it there."""
    if sb.arch_support(90):
        pytest.skip(sb.arch_support(90))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = sb.compile_builds([90], ["batch_lists-K7-int32"], timeout=300)
    assert out["archs"]["90"]["builds"]["batch_lists-K7-int32"]["ok"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("nk_static_")]
