"""A static gate for the compiled CPU kernel's machine code (nnkloss/cpu/csrc/op.cpp), on
both x86 vector widths whatever this machine has: the source is compiled as nnkloss/cpu/build.py
compiles it, for x86-64-v3 (AVX2 and FMA: the AMD EPYC this project has run on) and x86-64-v4
(AVX-512: the Intel Xeon), and the hot functions' instructions are read back (objdump).

Why: GCC's code for the kernel differed by ISA in ways no test on one machine saw. On AVX2 the
16 lanes, kept as one 64-byte vector, went through the stack at every step, `s * v` was built
from 16 scalar stores, the row's exponentials stayed scalar and bf16 rows widened in four
operations (the forward much slower); the first fix for `s * v` then became 16 masked moves
per gathered row with AVX-512, on a machine nobody could time. Each assertion below is one of
those regressions, and was seen to fail on the source that had it (build.FLAGS without
-fno-trapping-math: the AVX2 exponentials). GCC 12's code; another compiler may need its own
calibration.
"""
import os
import platform
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from nnkloss.cpu import build

TARGETS = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}


def _gcc():
    cxx = build._compiler()
    if cxx is None or shutil.which("objdump") is None or shutil.which("c++filt") is None:
        return None
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return cxx if ("GCC" in out or "g++" in out or "Free Software" in out) else None


pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or _gcc() is None,
    reason="needs GCC targeting x86-64 and binutils (objdump, c++filt)")


def _flags(march):
    """build.py's flags with -march=native replaced, an object file instead of a library."""
    flags = [f for f in build.FLAGS if f not in ("-march=native", "-shared")]
    return flags + [f"-march={march}", "-fopenmp", "-c"]


WARNINGS = {}  # isa: the compiler's warning lines (filled by the disassembly fixture)


@pytest.fixture(scope="module")
def disassembly():
    """{isa: {function name: [instruction lines]}} of the kernel compiled for each target (the
    two compiles run side by side: ~20 s each on the 2-core machine)."""
    cxx = _gcc()
    tmp = tempfile.mkdtemp(prefix="nnk_codegen_")

    def compile_for(item):
        isa, march = item
        obj = os.path.join(tmp, f"{isa}.o")
        res = subprocess.run([cxx] + _flags(march) + [build.SOURCES[0], "-o", obj],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        WARNINGS[isa] = [ln for ln in res.stderr.splitlines() if "warning:" in ln]
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", obj],
                              capture_output=True, text=True, check=True).stdout
        return isa, _functions(text)

    try:
        with ThreadPoolExecutor(2) as pool:
            return dict(pool.map(compile_for, TARGETS.items()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _functions(text):
    """{demangled name: [(address, instruction)]} of objdump's text."""
    funcs, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name is not None and "\t" in line:
            addr, ins = line.split("\t", 1)
            funcs[name].append((int(addr.strip().rstrip(":"), 16), ins.strip()))
    return funcs


def _code(funcs, signature):
    """[(address, instruction)] of the one function whose demangled name starts with
    ``signature`` (its lambdas left out)."""
    hits = [v for k, v in funcs.items() if k.startswith(signature) and "lambda" not in k]
    assert len(hits) == 1, (signature, [k for k in funcs if k.startswith(signature)])
    return hits[0]


def _one(funcs, signature):
    """The instructions of that function."""
    return [ins for _, ins in _code(funcs, signature)]


def _loops(funcs, signature, innermost=False):
    """The bodies (instruction lists) of the loops of a function: from the target of each
    backward branch to the branch. ``innermost``: only those that hold no other loop (an
    outer loop around an inlined sweep holds that sweep's instructions and more)."""
    code = _code(funcs, signature)
    where = {a: i for i, (a, _) in enumerate(code)}
    spans = []
    for i, (a, ins) in enumerate(code):
        m = re.match(r"^j\w+\s+([0-9a-f]+)\b", ins)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in where:
            spans.append((where[int(m.group(1), 16)], i))
    if innermost:
        spans = [(s, e) for s, e in spans
                 if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans)]
    return [[x for _, x in code[s:e + 1]] for s, e in spans]


STACK_VECTOR_STORE = re.compile(r"^vmov\w+\s+%[xyz]mm\d+,-?0x[0-9a-f]+\(%r[sb]p\)")

FIXED = "void (anonymous namespace)::row_distances_fixed<128l, float, float>("
FIXED_BF16 = ("void (anonymous namespace)::row_distances_fixed<128l, float, "
              "(anonymous namespace)::bf16>(")
ROW = "(anonymous namespace)::ForwardRow<float, float>::row(long, long)"


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_a_row_distance_keeps_its_lanes_in_registers(disassembly, isa):
    """One gathered row's scaled distance (row_distances_fixed, D 128): the 16 partial sums and
    the broadcast 1/sigma stay in registers (no vector store to the stack, no masked build of
    the broadcast), and the broadcast is one instruction."""
    code = _one(disassembly[isa], FIXED)
    assert not [i for i in code if STACK_VECTOR_STORE.match(i)], isa
    assert not [i for i in code if i.startswith("kmov")], isa
    assert sum(i.startswith("vbroadcastss") for i in code) == 1, isa


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_the_four_row_loop_keeps_its_sums_in_registers(disassembly, isa):
    """The groups of four (scaled_sqdist4, inlined in ForwardRow::row), the innermost loop that
    prefetches a line of four future rows and subtracts x from four rows per step (an outer
    loop around it may hold four prefetches too: those of the fold's sweep, NNK_FOLD_PREFETCH;
    a second call of scaled_sqdist4 in row() made GCC call it instead, which this test then
    failed by finding no such loop): on AVX2 GCC had kept the
    four rows' partial sums in memory and moved them through general registers (vmovq /
    vpinsrq) at every step: 128 instructions a step, 16 of them vmovq / vpinsrq and 32 stores
    to the stack, against 47, 0 and 2 now (GCC 12, x86-64-v3; AVX2 has 16 registers for the
    eight sums, x, 1/sigma and the rows, so a sum or two may be spilled). With AVX-512: 28
    instructions, no store, before and after."""
    loops = [b for b in _loops(disassembly[isa], ROW, innermost=True)
             if sum(i.startswith("prefetcht0") for i in b) == 4
             and sum(i.startswith("vsubps") for i in b) >= 4]
    assert loops, isa
    for body in loops:
        assert not [i for i in body if i.startswith(("vpinsrq", "vmovq"))], isa
        assert len([i for i in body if STACK_VECTOR_STORE.match(i)]) <= 2, (isa, body)
        assert len(body) <= 64, (isa, len(body))


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_the_rows_exponentials_are_simd_lanes(disassembly, isa):
    """vexp over a row's K entries vectorises: packed compares (vcmp...ps on ymm / zmm, or into
    a mask register) rather than scalar ones only (AVX2 needs -fno-trapping-math for this)."""
    code = _one(disassembly[isa], ROW)
    width = "ymm" if isa == "avx2" else "zmm"
    packed = [i for i in code if re.match(r"^vcmp\w*ps\s", i) and f"%{width}" in i]
    assert packed, isa


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_bf16_rows_widen_with_one_instruction_per_register(disassembly, isa):
    """bf16 -> fp32: one vpmovzxwd from memory into a full register per 8 (AVX2) / 16
    (AVX-512) elements, not 128-bit widenings stitched together with inserts."""
    code = _one(disassembly[isa], FIXED_BF16)
    width = "ymm" if isa == "avx2" else "zmm"
    widen = [i for i in code if re.match(r"^vpmovzxwd\s+-?(0x[0-9a-f]+)?\(", i)
             and f"%{width}" in i]
    assert len(widen) >= (16 if isa == "avx2" else 8), (isa, len(widen))
    assert not [i for i in code if i.startswith(("vinserti128", "vinserti32x4"))], isa


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_the_logits_are_simd_lanes_at_every_type(disassembly, isa):
    """The logits of a row's entries (list_logits_of, 12 builds for fp32 rows: int32 / int64
    lists and centre labels, no / fp32 / fp64 weights) run as SIMD lanes under the generic
    tuning too: every build that is a function of its own has a loop on full-width registers,
    and the fp32 builds have at least one such loop each. Before 2026-11-27 GCC found no vector
    type for this loop under generic tuning at any type (and under this CPU's for the weighted
    builds): 0 such loops."""
    funcs = disassembly[isa]
    width = "ymm" if isa == "avx2" else "zmm"
    names = [k for k in funcs if k.startswith((
        "bool (anonymous namespace)::list_logits_of<float,",
        "bool (anonymous namespace)::Lists::logits<float>("))]
    packed = {n: sum(1 for body in _loops(funcs, n) if any(f"%{width}" in i for i in body))
              for n in names}
    assert all(packed[n] > 0 for n in names if "list_logits_of" in n), (isa, packed)
    assert sum(packed.values()) >= 12, (isa, packed)


@pytest.mark.parametrize("isa", sorted(TARGETS))
def test_the_kernel_compiles_without_warnings(disassembly, isa):
    """cpu.py's flags give no warning on either target: until 2026-11-27 the classifier's
    rows at a compile-time D kept a tail loop that could not run, and GCC 12 warned that its
    iteration 2**63 invoked undefined behaviour (-Waggressive-loop-optimizations)."""
    assert WARNINGS[isa] == [], WARNINGS[isa][:5]


GRAD_PASS = "void (anonymous namespace)::grad_pass<float, {}>("
VECTOR_STORE = re.compile(r"^vmov\w+\s+%[xyz]mm\d+,.*\(")


@pytest.mark.parametrize("isa", sorted(TARGETS))
@pytest.mark.parametrize("row_type", ["float", "(anonymous namespace)::bf16",
                                      "(anonymous namespace)::fp16"])
def test_the_second_pass_keeps_its_block_in_registers(disassembly, isa, row_type):
    """The gradient's second pass (grad_pass): per gathered row, one FMA per register of the
    block of gradient columns, the block held in registers across the rows (before
    2026-11-27 the pass loaded and stored the gradient once per four rows). The largest block
    fills 16 registers with AVX-512 (GCC spills one row value to the stack there: one store)
    and 8 with AVX2; the next one, 8 registers with AVX-512, stores nothing and touches no
    stack. fp16 rows widen with F16C (vcvtph2ps), one per register."""
    width = "%zmm" if isa == "avx512" else "%ymm"
    # the block loops: packed FMAs only (the ragged end's loops hold scalar ones too)
    loops = [b for b in _loops(disassembly[isa], GRAD_PASS.format(row_type), innermost=True)
             if not [i for i in b if re.match(r"^vfmadd\w+ss\s", i)]]
    fmas = [sum(i.startswith("vfmadd") and width in i for i in b) for b in loops]
    full = 16 if isa == "avx512" else 8
    big = [b for b, f in zip(loops, fmas) if f == full]
    assert big, (isa, fmas)
    assert all(len([i for i in b if VECTOR_STORE.match(i)]) <= 1 for b in big), isa
    if isa == "avx512":
        half = [b for b, f in zip(loops, fmas) if f == 8]
        assert half, fmas
        for b in half:
            assert not [i for i in b if VECTOR_STORE.match(i)], b
            assert not [i for i in b if "(%rsp)" in i or "(%rbp)" in i], b
    if row_type.endswith("fp16"):
        assert all(sum("vcvtph2ps" in i for i in b) == full for b in big), isa
