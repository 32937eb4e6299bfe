"""Compiled CPU path of the fused op: a small C++ file built on first use, loaded with ctypes.

``forward`` and ``centre_grad`` follow the forward contract (nnkloss/ops/CONTRACT.md) exactly, like the
Triton launcher and the plain torch path. The source (``cpu_kernel.cpp``, no torch headers) is
compiled once per machine with the system compiler::

    c++ -O3 -march=native -std=c++17 -shared -fPIC -pthread -fopenmp cpu_kernel.cpp \
        -o <cache>/nnk_cpu_<hash>.so

(``-fopenmp`` where torch's own pool is the libgomp loaded in the process, so that the kernel
runs on torch's OpenMP team; ``-fopenmp-simd`` and the kernel's own std::threads otherwise; see
OPENMP_FLAGS below)
into a per-user cache directory (``$NNKLOSS_CACHE_DIR``, else ``$XDG_CACHE_HOME/nnkloss``, else
``~/.cache/nnkloss``; if that is unusable, ``<tmp>/nnkloss-<uid>``), keyed by a hash of the
source, the compiler's version, the flags and the CPU's feature flags, written to a temporary
file, fsync'ed and renamed into place (two processes that race both produce a complete library;
the last rename wins), its sha256 then recorded beside it (``<library>.sha256``, written the
same way).

Nothing found on disk is loaded unchecked. A cache directory is used only if it is owned by
this user and not writable by group or others (a missing one is created with mode 0700). A
library is loaded only if it is a regular file owned by this user, not writable by group or
others, and its bytes match the recorded sha256; the check and the load use the same open file
(``/proc/self/fd``), so the file cannot be swapped in between. A truncated, corrupt, foreign or
unrecorded library is rebuilt, never loaded. Any failure (no compiler, a failed build, no
private cache directory, a library that does not load or lacks a symbol, or
``NNKLOSS_CPU_KERNEL=0``) leaves ``available()`` False: a one-line warning is issued once, and
``forward`` / ``centre_grad`` run the plain torch path.

Inputs the host converts cheaply are converted here (emb to the compute dtype, labels to
int64, a half-precision weight vector to fp32); the bank (centres, centre_labels) is read as it
is: fp32 / fp64 / bf16 / fp16 centres, int32 / int64 labels and neighbours. Anything else
(other dtypes, non-contiguous bank, non-CPU tensors) runs the plain torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import numbers
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from ..atomic import atomic_write
from ..threads import ThreadGovernor
from . import reference

__all__ = ["available", "forward", "centre_grad", "scale_rows", "rel_sqdist", "batch_lists",
           "gather_lists", "value_flags", "counted_mean", "gather_read", "build_info",
           "library_path", "knn_selection", "gemm_nt"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernel.cpp")
# -fno-trapping-math: the kernel never reads the floating-point exception flags, and without it
# GCC 12 keeps the row's exponentials (vexp: compares and selects) scalar on a CPU without
# AVX-512's masks ("control flow in loop"); it changes no result (no reassociation, no
# contraction beyond -O3's). Measured on the 2-core AMD EPYC (AVX2, 2026-11-25): see
# benchmarks/results/HISTORY.md, "The CPU kernel on the 2-core AMD EPYC" (`aa60d9f`).
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fno-trapping-math", "-shared", "-fPIC"]
# Whose threads (issue 21): torch's. Where torch's own intra-op pool is libgomp (torch's
# parallel backend is OpenMP and a libgomp.so.1 is loaded in this process, as with the Linux
# wheels), the kernel is built with -fopenmp: its parallel loops are `#pragma omp parallel`
# regions, and the libgomp.so.1 it needs is the one torch already loaded (same soname), so the
# op runs on torch's OpenMP team, the same worker threads as torch's ops: one pool, never two
# sets of threads spinning against each other. Measured on the 2-core machine, load 0.3-1.1,
# forward+backward at the 4 bench_loss CPU shapes, speed at 2 threads over 1: 1.6-1.9x on
# torch's team (8 of 8 shape-runs faster); 0.2-1.5x with the kernel's own std::threads beside
# torch's spinning workers (10 of 16 slower than one thread).
OPENMP_FLAGS = ["-pthread", "-fopenmp"]
# Elsewhere (no libgomp in the process: another OpenMP runtime would be a second pool) the
# kernel's own claim-based std::threads (run_items), OpenMP pragmas as simd hints only.
THREAD_FLAGS = ["-pthread", "-fopenmp-simd"]
PLAIN_FLAGS = ["-pthread"]  # a compiler without -fopenmp-simd: the loops still auto-vectorise

_BANK_TYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_INDEX_TYPES = {torch.int32: 0, torch.int64: 1}

_lock = threading.Lock()
_state = {"lib": None, "tried": False, "error": None, "path": None, "compile_s": None,
          "warned": False, "pool": None}


def _compiler() -> Optional[str]:
    for name in (os.environ.get("NNKLOSS_CXX"), os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def cache_dir() -> str:
    d = os.environ.get("NNKLOSS_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "nnkloss")
    return d


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_key(cxx: str, flags) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    for part in (cxx, version, " ".join(flags), _cpu_flags(), platform.machine()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


class _Untrusted(Exception):
    """A cached library (or its recorded checksum) that must not be loaded: rebuild it."""


def _fallback_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"nnkloss-{os.getuid()}")


def _private_dir(d: str) -> str:
    """``d`` if this user owns it and neither group nor others can write to it (created with mode
    0700 when missing); otherwise OSError saying why. Another user who can write to the
    directory could plant a library there (the cache key is computable by anyone)."""
    try:
        os.makedirs(d, mode=0o700)
    except FileExistsError:
        pass
    st = os.stat(d)  # follows a symlink: what matters is the directory the files land in
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{d} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{d} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise PermissionError(f"{d} is writable by group or others "
                              f"(mode {oct(st.st_mode & 0o777)})")
    return d


def _usable_cache_dir() -> str:
    """The configured cache directory, else ``<tmp>/nnkloss-<uid>``, whichever is private first;
    RuntimeError naming both and why when neither is (the plain path runs then)."""
    reasons = []
    for d in (cache_dir(), _fallback_dir()):
        try:
            return _private_dir(d)
        except OSError as exc:
            reasons.append(str(exc) if not exc.filename else f"{d}: {exc.strerror}")
    raise RuntimeError("no private cache directory (" + "; ".join(reasons) + ")")


def _check_owned_file(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Untrusted(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{path} is writable by group or others")


def _sha256_of(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _recorded_sha256(path: str) -> str:
    """The sha256 written beside ``path`` at build time (the record passes the owner checks)."""
    record = path + ".sha256"
    try:
        fd = os.open(record, _OPEN_FLAGS)
    except OSError as exc:
        raise _Untrusted(f"{record}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        _check_owned_file(os.fstat(f.fileno()), record)
        text = f.read(100).decode("ascii", "replace").strip()
    if len(text) != 64 or text.strip("0123456789abcdef"):
        raise _Untrusted(f"{record} does not hold a sha256")
    return text


def _open_verified(path: str) -> int:
    """A file descriptor open on ``path`` once its owner, mode and sha256 have been checked on
    that same descriptor (what gets loaded is what was checked); _Untrusted otherwise.
    Reading, unlike mapping, a truncated file cannot raise SIGBUS."""
    expected = _recorded_sha256(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _Untrusted(f"{path}: {exc.strerror}") from None
    try:
        _check_owned_file(os.fstat(fd), path)
        with os.fdopen(os.dup(fd), "rb") as f:
            f.seek(0)
            digest = _sha256_of(f)
        if digest != expected:
            raise _Untrusted(f"{path} does not match the sha256 recorded when it was built "
                             "(truncated or modified)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _first_error(stderr: str) -> str:
    """The line of a compiler's stderr that says what failed: the first one with "error"
    (GCC and Clang end a diagnostic with source and caret lines, which say nothing alone),
    else the last line, else "?"."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error" in line), lines[-1] if lines else "?")


def _compile(cxx: str, flags, out_dir: str) -> str:
    """Compile to a temporary file in ``out_dir``, fsync it, rename it to its keyed name and
    record its sha256 beside it. A library already there is reused only if it verifies
    (:func:`_open_verified`); a missing, truncated, modified or foreign one is rebuilt."""
    path = os.path.join(out_dir, f"nnk_cpu_{_cache_key(cxx, flags)}.so")
    try:
        os.close(_open_verified(path))
        return path
    except _Untrusted:
        pass  # build it afresh; the rename below replaces whatever is there
    fd, tmp = tempfile.mkstemp(prefix=".nnk_cpu_", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, SOURCE, "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cxx)} failed: {_first_error(proc.stderr)}")
        os.chmod(tmp, 0o755)  # whatever the umask: group/other-writable would be refused
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes reach the disk before the name does
            digest = _sha256_of(f)
        os.replace(tmp, path)  # atomic: a racing process sees the old name or the whole file
        # Recorded after the rename: a reader that finds the new library with an older record
        # (a racing build) refuses it and rebuilds; it never loads unrecorded bytes.
        atomic_write(path + ".sha256", digest.encode("ascii") + b"\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# Descriptors of loaded libraries stay open: dlopen knows a library by the name it was given
# (/proc/self/fd/<n>) and must never meet that name again for another file.
_loaded_fds = []


def _load(path: str):
    """Load the verified library at ``path`` through the descriptor that was checked."""
    fd = _open_verified(path)
    target = f"/proc/self/fd/{fd}"
    if os.path.exists(target):
        _loaded_fds.append(fd)
    else:  # no /proc: by name (the private directory keeps others from swapping the file)
        os.close(fd)
        target = path
    return _declare(ctypes.CDLL(target))


def _declare(lib):
    P, I, I64, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    lib.nnk_forward.argtypes = [I, I, P, P, I, P, P, I, P, I, P, I, D, I64, I64, I64, I64, I,
                                P, P, P, P, P, I]
    lib.nnk_forward.restype = I
    lib.nnk_centre_grad.argtypes = [I, I, P, P, P, I, P, I64, I64, I64, I64, P, I]
    lib.nnk_centre_grad.restype = I
    lib.nnk_scale_rows.argtypes = [I, P, P, I64, P, I64, I64, P, I]
    lib.nnk_scale_rows.restype = I
    lib.nnk_entry_grads.argtypes = [I, P, P, I, P, I, P, I, P, I, P, P, P, I64, I64, I64, I64,
                                    D, P, P, P, I]
    lib.nnk_entry_grads.restype = I
    lib.nnk_rel_sqdist.argtypes = [I, I, P, P, I64, P, P, I64, I64, I64, P, I]
    lib.nnk_rel_sqdist.restype = I
    lib.nnk_batch_lists.argtypes = [P, I, I64, I64, P, I, P, I, P, I, I64, I, P, P]
    lib.nnk_batch_lists.restype = I64
    lib.nnk_counted_mean.argtypes = [I, P, P, I64, P, P]
    lib.nnk_counted_mean.restype = I
    lib.nnk_has_same_label.argtypes = [P, I, I64, I64, P, I, P]
    lib.nnk_has_same_label.restype = I
    lib.nnk_list_overlap.argtypes = [P, I, I64, P, I, I64, I64, I64, P, P]
    lib.nnk_list_overlap.restype = I
    lib.nnk_gathered_finite.argtypes = [P, I, I64, I64, P, I, I64, I]
    lib.nnk_gathered_finite.restype = I
    lib.nnk_gather_read.argtypes = [P, I64, I64, P, I, I64, I]
    lib.nnk_gather_read.restype = ctypes.c_uint64
    lib.nnk_check_values.argtypes = [P, I, I64, P, I, I64, P, I, I64, P]
    lib.nnk_check_values.restype = I
    lib.nnk_vexp.argtypes = [P, P, I64]
    lib.nnk_vexp.restype = I
    lib.nnk_knn_select.argtypes = [P, I64, I64, I64, I64, I64, I64, P, P, P, I]
    lib.nnk_knn_select.restype = I
    lib.nnk_knn_select_sym.argtypes = [P, I64, I64, I64, I64, I64, I64, I64, P, P, P, I]
    lib.nnk_knn_select_sym.restype = I
    lib.nnk_knn_pad.argtypes = [I64, I64, I64, P, P, I]
    lib.nnk_knn_pad.restype = I
    lib.nnk_knn_unkey.argtypes = [I64, I64, I64, P, P, P, I64, I]
    lib.nnk_knn_unkey.restype = I
    lib.nnk_gemm_nt.argtypes = [P, I64, P, I64, P, I64, I64, I64, I64, I]
    lib.nnk_gemm_nt.restype = I
    lib.nnk_run_items.argtypes = [I64, I, _ITEM_CALLBACK]
    lib.nnk_run_items.restype = I
    return lib


def _build_and_load():
    if os.environ.get("NNKLOSS_CPU_KERNEL", "1") == "0":
        raise RuntimeError("disabled by NNKLOSS_CPU_KERNEL=0")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    out_dir = _usable_cache_dir()
    t0 = time.perf_counter()
    errors = []
    for extra in flag_choices():
        try:
            before = _loaded_libgomp()
            path = _compile(cxx, FLAGS + extra, out_dir)
            lib = _load(path)
            if extra is OPENMP_FLAGS and _loaded_libgomp() != before:
                # never a second OpenMP runtime (a second pool) brought in by the kernel
                raise RuntimeError(f"{path} loaded another libgomp: {_loaded_libgomp()}")
            break
        except (OSError, RuntimeError, subprocess.SubprocessError, _Untrusted) as exc:
            errors.append(str(exc))
        except AttributeError as exc:  # a library without one of the kernel's symbols
            errors.append(f"{path}: {exc}")
    else:
        raise RuntimeError("; ".join(errors))
    _state.update(path=path, compile_s=time.perf_counter() - t0,
                  pool="torch-openmp" if lib.nnk_openmp() else "own-threads")
    return lib


def _loaded_libgomp() -> list:
    """Paths of the libgomp libraries mapped into this process (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f
                           if os.path.basename(line.split()[-1]).startswith("libgomp")})
    except OSError:
        return []


def torch_libgomp() -> Optional[str]:
    """The libgomp torch's intra-op pool runs on, if torch's parallel backend is OpenMP: the
    ``libgomp.so.1`` in torch's own lib directory (the wheels'), else the only libgomp loaded;
    None otherwise (the kernel then uses its own threads). Other packages' renamed copies
    (``libgomp-<hash>.so``, e.g. scikit-learn's) have other sonames: a -fopenmp library, which
    asks for ``libgomp.so.1``, binds to torch's."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    found = _loaded_libgomp()
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    for path in found:
        if (os.path.basename(path) == "libgomp.so.1"
                and os.path.dirname(os.path.realpath(path)) == torch_lib):
            return path
    return found[0] if len(found) == 1 else None


def flag_choices() -> list:
    """The thread flags tried, in order (each after FLAGS): torch's OpenMP team where torch's
    pool is libgomp, then own threads, then plain."""
    return ([OPENMP_FLAGS] if torch_libgomp() else []) + [THREAD_FLAGS, PLAIN_FLAGS]


def _lib():
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            try:
                _state["lib"] = _build_and_load()
            except Exception as exc:  # any failure: the plain torch path runs instead
                _state["error"] = str(exc)
            _state["tried"] = True
            _build_notice()
    if _state["lib"] is None and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(f"nnkloss: compiled CPU kernel unavailable ({_state['error']}); "
                      "using the plain PyTorch path", RuntimeWarning, stacklevel=3)
    return _state["lib"]


# A build slower than this was a compile (loading a cached library takes milliseconds).
NOTICE_AFTER_S = 1.0


def _build_notice():
    """One line, once per process, when this process compiled the kernel (the first CPU call
    waits for it, ~5 s); nothing when the cached library was loaded."""
    spent = _state["compile_s"]
    if _state["lib"] is not None and spent is not None and spent >= NOTICE_AFTER_S:
        logging.getLogger("nnkloss").warning(
            "nnkloss: compiled the CPU kernel in %.1f s (once per machine; cached in %s)",
            spent, os.path.dirname(_state["path"]))


def available() -> bool:
    """True when the compiled CPU kernel is built and loaded (builds it on the first call)."""
    return _lib() is not None


def build_info() -> dict:
    """Library path, build/load seconds of this process's first call, error, and whose
    threads the kernel runs on ("torch-openmp": torch's OpenMP team; "own-threads")."""
    _lib()
    return {k: _state[k] for k in ("path", "compile_s", "error", "pool")}


def library_path() -> Optional[str]:
    return build_info()["path"]


def _reset_for_tests():
    with _lock:
        _state.update(lib=None, tried=False, error=None, path=None, compile_s=None,
                      warned=False, pool=None)


def _supported(emb, centres, centre_labels, neighbours, weights) -> bool:
    # is_cpu, not device.type: no torch.device object per tensor (~2 us a call in all)
    return (emb.is_cpu and centres.is_cpu and centre_labels.is_cpu and neighbours.is_cpu
            and (weights is None or weights.is_cpu)
            and emb.dtype in _BANK_TYPES and centres.dtype in _BANK_TYPES
            and centres.is_contiguous() and centre_labels.is_contiguous()
            and centre_labels.dtype in _INDEX_TYPES and neighbours.dtype in _INDEX_TYPES
            and (weights is None or weights.is_floating_point())
            and emb.dim() == 2 and centres.dim() == 2 and emb.shape[1] == centres.shape[1])


# Whose threads: torch's OpenMP team where torch's pool is libgomp (see OPENMP_FLAGS), else the
# kernel's own claim-based std::threads (run_items in the .cpp). How many: at most
# torch.get_num_threads() (the one knob for torch and the op: torch.set_num_threads /
# OMP_NUM_THREADS), and each thread gets at least this many gathered elements (B*K*D) of work:
# a parallel region costs microseconds, which smaller shares would not repay.
PARALLEL_MIN_ELEMS = 1 << 16
# scale_rows streams B*D elements once with one multiply each, so a share must be far bigger to
# repay a parallel region: measured on the 2-core AMD machine (2026-11-24), one thread took
# 8.5 us at 2^17 elements against 13.1 us at two, 42.5 against 56.3 us at 2^19, and two threads
# won from 2^21 (126 against 181 us).
SCALE_MIN_ELEMS = 1 << 20

# And, by default, whichever of that count and one thread is measured to be faster (issue 21):
# a ThreadGovernor per entry point times the calls (cost per gathered element), probes the
# full count and one thread, keeps the faster and re-probes with back-off (nnkloss/threads.py).
# An OpenMP team's closing barrier waits for its slowest thread, and beside another process that
# keeps the cores busy that thread is often descheduled for a whole time slice: there one thread
# is faster (measured on the 2-core machine: forward+backward 2-6x slower at 2 threads beside a
# 2-thread matmul), idle two threads are (1.6-1.8x). The result does not depend on the count
# (every row is computed by one thread, the centre gradient in a fixed order): only the time
# does. Where the machine's run queue describes our CPUs (Linux, nnkloss.threads.run_queue),
# the governors also read other processes' runnable threads: no probe of the full count while
# they leave it no room, and a drop to one thread when they arrive. A read costs 40-130 us, so
# reads take at most 0.25% of the op's time (sample_budget; 16 ms of calls apart at 40 us, and
# a skipped probe's hold lengthened to keep its reads within it), never one per call: beside a
# busy process the default must not be slower than one thread (issue 21), and at 1% with one
# forced read per skipped probe the reads alone cost 1-1.9% of 0.25-0.5 ms calls there. A
# competitor that arrives is still seen within ~32 ms of calls, one that leaves within ~0.1 s
# (record + threads() cost 2.6 us per call with the signal, 1.1 us without, at the full count
# with 0.1 ms calls). NNKLOSS_GOVERN_THREADS=0 turns
# the governors off (the full count always). Each starts at the full count where the run queue
# shows room for it (start="auto"), else at one thread: entry points called a few times per run
# (the classifier, evaluation) would otherwise run all their calls at one thread.
GOVERNOR_OPTIONS = dict(warmup=3, window=5, hold=50, max_hold=3200, signal="auto",
                        start="auto", sample_budget=0.0025)
_governors = {}


# NNKLOSS_GOVERN_THREADS is read at every governed call (tests and benchmarks switch it within
# a process), from os.environ's own mapping: os.environ.get runs its key and value through
# Python-level encoders, 4.6 us a read after a kernel that swept the caches, against the
# op's 1 ms calls (measured on the 2-core Intel Xeon, 2026-11-27). The mapping is the one
# os.environ (and monkeypatch.setenv) updates; where it is not there, os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None)
try:
    _GOVERN_KEY = os.environ.encodekey("NNKLOSS_GOVERN_THREADS")
    _GOVERN_OFF = os.environ.encodevalue("0")
except (AttributeError, TypeError):  # not CPython's os._Environ
    _ENV_DATA = None


def governing() -> bool:
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_GOVERN_KEY) != _GOVERN_OFF
    return os.environ.get("NNKLOSS_GOVERN_THREADS", "1") != "0"


def governor(name: str) -> ThreadGovernor:
    """The ThreadGovernor of one entry point: the op's "forward", "centre_grad" and
    "scale_rows"; the exact search's "gemm" (its distance tiles) and "knn_select" (their folds
    into the selections, whose choice the finish follows)."""
    g = _governors.get(name)
    if g is None:
        g = _governors.setdefault(name, ThreadGovernor(full_threads, **GOVERNOR_OPTIONS))
    return g


def _threads(work: int, min_elems: Optional[int] = None) -> int:
    """One thread per ``min_elems`` elements of work (default PARALLEL_MIN_ELEMS), at least
    one, at most the full count (:func:`full_threads`)."""
    return max(1, min(full_threads(), work // (min_elems or PARALLEL_MIN_ELEMS)))


# The full thread count while iter_following has lowered torch's (per Python thread).
_lowered = threading.local()


def full_threads() -> int:
    """torch's thread count, or, while :func:`iter_following` has lowered it for torch's own
    ops, the count it had: what the library's calls and their governors take as full."""
    return getattr(_lowered, "full", None) or torch.get_num_threads()


def iter_following(blocks, name: str):
    """Yield the items of the iterator ``blocks`` with torch's thread count, while each is
    produced and while the caller works on it, lowered to the current choice of the governor
    ``name`` (and restored between items and at the end): torch's own ops between the
    library's governed calls (a search's augmented copies, the self-exclusion, evaluate's
    metrics on each block) then run at the count the governor found best, one thread beside
    a busy process. Measured on the 2-core AMD EPYC family 26 beside a 2-thread matmul loop
    (2026-11-27), evaluation of 30,000 points: with the search's calls governed but torch's
    ops at two threads, 4.4-4.7 s against 1.8-2.2 at one thread. The library's calls keep
    the full count as theirs (:func:`full_threads`), so their governors go on timing and
    probing it. Only on the main thread (torch's count is the process's: a background
    thread's search, e.g. the refresher's, leaves it to the training loop) and where the
    governors run (NNKLOSS_GOVERN_THREADS)."""
    it = iter(blocks)
    while True:
        full = torch.get_num_threads()
        lower = (full > 1 and governing() and getattr(_lowered, "full", None) is None
                 and threading.current_thread() is threading.main_thread())
        n = min(full, governor(name).threads()) if lower else full
        if n < full:
            _lowered.full = full
            torch.set_num_threads(n)
        try:
            try:
                item = next(it)
            except StopIteration:
                return
            yield item
        finally:
            if n < full:
                torch.set_num_threads(full)
                _lowered.full = None


def _governed_threads(name: str, work: int, min_elems: Optional[int] = None) -> int:
    """The count :func:`_threads` gives, or the governor's current choice when it is smaller
    (the governor is not fed: for a call whose time is not a unit of its work, e.g. a
    selection's finish, which follows the selection's governor)."""
    n = _threads(work, min_elems)
    return n if n <= 1 or not governing() else min(n, governor(name).threads())


def _run(name: str, work: int, call, min_elems: Optional[int] = None) -> int:
    """``call(nthreads)`` with the count of :func:`_threads`, or the governor's choice when it
    is smaller; the call's time is reported to the governor. Returns the call's result."""
    n = _threads(work, min_elems)
    if n <= 1 or not governing():
        return call(n)
    gov = _governors.get(name) or governor(name)
    side = gov.threads()
    n = min(n, side)
    t0 = time.perf_counter()
    rc = call(n)
    # Reported at the governor's count (its side), not at n: a call whose work caps it below
    # the wide count runs the wide side as far as its work repays. Reported at n it was a unit
    # at "another count", dropped whole: with such calls alone the governor never left its
    # warm-up or probe, and its signal never dropped the count (16 threads' governor, calls at
    # 4, beside 15 busy CPUs: 4 threads for good). A change of the governor's count between
    # the read and the record (another thread's call) still leaves the unit untimed.
    gov.record(time.perf_counter() - t0, work, threads=side)
    return rc


def _weights_arg(weights):
    """(weights as the library reads them, their type code): None, 0 without weights; else
    fp32 (1) or fp64 (2), other float dtypes as fp32, contiguous."""
    if weights is None:
        return None, 0
    w = weights.detach()
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    return w.contiguous(), 1 if w.dtype == torch.float32 else 2


def _ptr(t):
    return None if t is None else t.data_ptr()


def forward(emb, labels, centres, centre_labels, neighbours, weights, sigma, store_dist=True,
            need_grad_x=True):
    """The fused forward (nnkloss/ops/CONTRACT.md): loss, lse_all, lse_pos (B,), grad_x (B, D)
    and dist (B, K); grad_x is (B, 0) when ``need_grad_x`` is False (the kernel's forward-only
    path: one pass over the gathered rows, no gradient terms), dist (B, 0) when ``store_dist``
    is False; all in the compute dtype."""
    lib = _lib()
    if lib is None or not _supported(emb, centres, centre_labels, neighbours, weights):
        return reference.forward(emb, labels, centres, centre_labels, neighbours, weights,
                                 sigma, store_dist=store_dist, need_grad_x=need_grad_x)
    cdt = reference.compute_dtype(emb)
    B, D = emb.shape
    K = neighbours.shape[1]
    N = centres.shape[0]
    # The library reads B labels and list rows, and N centre labels and weights, through bare
    # pointers: shapes that disagree (a direct call of the custom op; the functional op checks
    # them) would read past the tensors.
    if (labels.shape != (B,) or neighbours.shape[0] != B or centre_labels.shape != (N,)
            or (weights is not None and weights.shape != (N,))):
        raise ValueError(_shape_error(emb, labels, centres, centre_labels, neighbours, weights))
    # Only pointers are passed, so nothing is detached (an autograd-free read); a tensor is
    # converted or copied only where its dtype or layout is not the library's.
    x = emb if emb.dtype == cdt and emb.is_contiguous() else emb.detach().to(cdt).contiguous()
    lab = labels
    if lab.dtype not in _INDEX_TYPES:  # int32 / int64 are read as they are (no copy)
        lab = lab.to(torch.int64)
    lab = lab.contiguous()
    nb = neighbours.contiguous()
    w, wtype = _weights_arg(weights)
    s = float(sigma.detach()) if isinstance(sigma, torch.Tensor) else float(sigma)
    loss, lse_all, lse_pos, grad_x, dist = reference.empty_outputs(emb, K, store_dist,
                                                                   need_grad_x)
    if B == 0:
        return loss, lse_all, lse_pos, grad_x, dist
    rc = _run("forward", B * K * D, lambda n: lib.nnk_forward(
        int(cdt == torch.float64), _BANK_TYPES[centres.dtype], x.data_ptr(), lab.data_ptr(),
        int(lab.dtype == torch.int64),
        centres.data_ptr(), centre_labels.data_ptr(), int(centre_labels.dtype == torch.int64),
        nb.data_ptr(), int(nb.dtype == torch.int64), _ptr(w), wtype, s, B, K, D, N,
        int(bool(store_dist)), loss.data_ptr(), lse_all.data_ptr(), lse_pos.data_ptr(),
        grad_x.data_ptr() if need_grad_x else None, dist.data_ptr() if store_dist else None, n))
    if rc != 0:
        raise RuntimeError(f"nnk_forward failed (code {rc})")
    return loss, lse_all, lse_pos, grad_x, dist


def _shape_error(emb, labels, centres, centre_labels, neighbours, weights) -> str:
    shapes = [("emb", emb), ("labels", labels), ("centres", centres),
              ("centre_labels", centre_labels), ("neighbours", neighbours), ("weights", weights)]
    return ("forward: shapes disagree (emb (B, D), labels (B,), centres (N, D), centre_labels "
            "(N,), neighbours (B, K), weights (N,) or None): "
            + ", ".join(f"{n} {None if t is None else tuple(t.shape)}" for n, t in shapes))


def centre_grad(emb, centres, neighbours, coef):
    """(N, D) in the compute dtype: grad[j] += coef[b, k] * (emb[b] - centres[j]) for every
    neighbours[b, k] = j >= 0 (coef already holds 1/sigma^2; zero entries are skipped)."""
    lib = _lib()
    if lib is None or not _supported(emb, centres, neighbours, neighbours, None):
        return reference.centre_grad(emb, centres, neighbours, coef.contiguous())
    cdt = reference.compute_dtype(emb)
    B, D = emb.shape
    K = neighbours.shape[1]
    N = centres.shape[0]
    if neighbours.shape[0] != B or coef.shape != neighbours.shape:  # read through pointers
        raise ValueError(f"centre_grad: neighbours {tuple(neighbours.shape)} and coef "
                         f"{tuple(coef.shape)} must both be ({B}, K) for emb {tuple(emb.shape)}")
    grad = torch.zeros(N, D, dtype=cdt)
    if B == 0 or K == 0 or N == 0:
        return grad
    x = emb.detach().to(cdt).contiguous()
    c = coef.detach().to(cdt).contiguous()
    nb = neighbours.detach().contiguous()
    rc = _run("centre_grad", B * K * D, lambda n: lib.nnk_centre_grad(
        int(cdt == torch.float64), _BANK_TYPES[centres.dtype], x.data_ptr(), centres.data_ptr(),
        nb.data_ptr(), int(nb.dtype == torch.int64), c.data_ptr(), B, K, D, N, grad.data_ptr(),
        n))
    if rc != 0:
        raise RuntimeError(f"nnk_centre_grad failed (code {rc})")
    return grad


def scale_rows(grad_x, g, lse_pos=None):
    """``g[:, None] * grad_x`` (the backward's embedding gradient) in one pass on the kernel's
    threads (governed like the forward). A row takes no gradient, and passes none on (NaN rows
    too), where ``g == 0`` or, when ``lse_pos`` (B,) is given, where ``lse_pos == -inf`` (no
    same-class neighbour): the kernel applies that rule itself, so the backward builds no mask.
    ``g`` (B,) may be an expanded scalar (stride 0, as autograd passes a reduced loss's
    gradient): it is read as it is. One call instead of torch's ne / where / mul chain."""
    lib = _lib()
    g = g.to(grad_x.dtype)
    if lse_pos is not None:
        lse_pos = lse_pos.to(grad_x.dtype).contiguous()
    if (lib is None or grad_x.device.type != "cpu" or not grad_x.is_contiguous()
            or grad_x.dtype not in (torch.float32, torch.float64)
            or g.shape != grad_x.shape[:1]
            or (lse_pos is not None and lse_pos.shape != grad_x.shape[:1])):
        takes = g != 0 if lse_pos is None else (g != 0) & (lse_pos != float("-inf"))
        return torch.where(takes[:, None], g[:, None] * grad_x, 0.0)
    B, D = grad_x.shape
    out = torch.empty_like(grad_x)
    rc = _run("scale_rows", B * D, lambda n: lib.nnk_scale_rows(
        int(grad_x.dtype == torch.float64), grad_x.data_ptr(), g.data_ptr(), g.stride(0),
        _ptr(lse_pos), B, D, out.data_ptr(), n), SCALE_MIN_ELEMS)
    if rc != 0:
        raise RuntimeError(f"nnk_scale_rows failed (code {rc})")
    return out


def entry_grads_supported(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos,
                          g) -> bool:
    """Whether :func:`entry_grads` runs here for these tensors (their dtypes, devices and
    shapes only: it reads no data, so it answers for fake tensors too)."""
    return (_lib() is not None and u.dtype in (torch.float32, torch.float64)
            and all(t.device.type == "cpu" for t in (u, labels, centre_labels, neighbours,
                                                      lse_all, lse_pos, g))
            and neighbours.dtype in _INDEX_TYPES and labels.dtype in _INDEX_TYPES
            and centre_labels.dtype in _INDEX_TYPES
            and (weights is None or (weights.device.type == "cpu" and weights.dim() == 1))
            and u.dim() == 2 and u.shape == neighbours.shape and g.shape == u.shape[:1]
            # read through pointers: B labels and log-sum-exps, a weight per centre label
            and labels.shape == g.shape and lse_all.shape == g.shape
            and lse_pos.shape == g.shape and centre_labels.dim() == 1
            and (weights is None or weights.shape == centre_labels.shape))


def entry_grads(u, labels, centre_labels, neighbours, weights, lse_all, lse_pos, g, sigma,
                need_coef: bool, need_q: bool, need_srow: bool):
    """The backward's per-entry terms for the centre, weight and sigma gradients in one pass
    (``EntryGrads`` in cpu_kernel.cpp: the torch form of ``_backward`` per entry, from the
    forward's saved distances ``u`` (B, K) and log-sum-exps): ``(coef, q, srow)``, coef and q
    (B, K) and srow (B,) in u's dtype, each None unless asked for (q also without weights).
    coef = (p - p^R) g / sigma^2 (the centre gradient's coefficients), q = (p - p^R) g / w (a
    zero weight's one-sided derivative there), srow = sum_j (p_j - p^R_j) g (u_j - u_ref),
    whose sum over rows times 1 / sigma is sigma's gradient. ``g`` (B,) may be an expanded
    scalar (read as it is). The row rules are the torch form's (rows with no same-class entry
    or g == 0: zeros; non-finite rows that take a gradient: NaN). None where
    :func:`entry_grads_supported` says no: the caller runs the torch form."""
    if not entry_grads_supported(u, labels, centre_labels, neighbours, weights, lse_all,
                                 lse_pos, g):
        return None
    lib = _lib()
    cdt = u.dtype
    B, K = u.shape
    w, wtype = _weights_arg(weights)
    uc = u.detach().contiguous()
    nb = neighbours.detach().contiguous()
    lab = labels.detach().contiguous()
    cl = centre_labels.detach().contiguous()
    la = lse_all.detach().to(cdt).contiguous()
    lp = lse_pos.detach().to(cdt).contiguous()
    gg = g.detach().to(cdt)
    if gg.stride(0) != 0:
        gg = gg.contiguous()
    s = float(sigma.detach()) if isinstance(sigma, torch.Tensor) else float(sigma)
    coef = torch.empty(B, K, dtype=cdt) if need_coef else None
    q = torch.empty(B, K, dtype=cdt) if need_q and w is not None else None
    srow = torch.empty(B, dtype=cdt) if need_srow else None
    if B * K == 0:
        return (None if coef is None else coef.zero_(), None if q is None else q.zero_(),
                None if srow is None else srow.zero_())
    inv = 1.0 / s
    # An entry costs about what 16 gathered elements of the forward do (two exponentials, a
    # few gathered loads): the same threshold for going parallel.
    rc = _run("entry_grads", B * K * 16, lambda n: lib.nnk_entry_grads(
        int(cdt == torch.float64), uc.data_ptr(), nb.data_ptr(), int(nb.dtype == torch.int64),
        lab.data_ptr(), int(lab.dtype == torch.int64), cl.data_ptr(),
        int(cl.dtype == torch.int64), _ptr(w), wtype, la.data_ptr(), lp.data_ptr(),
        gg.data_ptr(), gg.stride(0), B, K, cl.shape[0], inv * inv, _ptr(coef), _ptr(q),
        _ptr(srow), n))
    if rc != 0:
        raise RuntimeError(f"nnk_entry_grads failed (code {rc})")
    return coef, q, srow


def rel_sqdist(x, centres, idx, ref, cdt):
    """(Q, K) ``||x_q - c_i||^2 - ||x_q - c_r||^2`` for i = idx[q, :], r = ref[q], in ``cdt``
    (fp32 / fp64), in the product form of the classifier
    (:func:`nnkloss.evaluation.classifier._sq_dist_minus_ref`), one pass over the gathered
    rows on the kernel's threads (governed like the forward), without its (Q, K, D) blocks.
    ``x`` (Q, D) float, ``centres`` (N, D) fp32 / fp64 / bf16 / fp16, ``idx`` (Q, K) and
    ``ref`` (Q,) integer bank rows. None where this is not done here: the library
    unavailable, non-CPU tensors, other dtypes, a non-contiguous bank. An index outside
    [0, N) raises IndexError."""
    lib = _lib()
    if (lib is None or not (x.is_cpu and centres.is_cpu and idx.is_cpu and ref.is_cpu)
            or cdt not in (torch.float32, torch.float64) or centres.dtype not in _BANK_TYPES
            or not centres.is_contiguous() or centres.dim() != 2 or x.dim() != 2
            or idx.dim() != 2 or x.shape[1] != centres.shape[1]
            or ref.shape != idx.shape[:1] or x.shape[0] != idx.shape[0]):
        return None
    Q, K = idx.shape
    D = x.shape[1]
    xc = x.detach().to(cdt).contiguous()
    ic = idx.detach().to(torch.int64).contiguous()
    rf = ref.detach().to(torch.int64).contiguous()
    out = torch.empty(Q, K, dtype=cdt)
    if out.numel() == 0:
        return out
    rc = _run("rel_sqdist", Q * K * D, lambda n: lib.nnk_rel_sqdist(
        int(cdt == torch.float64), _BANK_TYPES[centres.dtype], xc.data_ptr(),
        centres.data_ptr(), centres.shape[0], ic.data_ptr(), rf.data_ptr(), Q, K, D,
        out.data_ptr(), n))
    if rc == 3:
        raise IndexError(f"idx and ref must be bank rows in [0, {centres.shape[0]})")
    if rc != 0:
        raise RuntimeError(f"nnk_rel_sqdist failed (code {rc})")
    return out


def batch_lists(table, idx, labels, centre_labels, exclude_self: bool):
    """``(lists, counts)`` of a batch in one call (``nnk_batch_lists``): the CPU twin of
    ``kernels/batch_lists.py``, with its contract (see there). ``lists`` (B, K) in the table's
    dtype: ``table[idx[b]]``, each row's own index -1 when ``exclude_self``, all -1 for a
    dropped row (its label not ``centre_labels[idx[b]]``, or its idx outside [0, N)); ``counts``
    (2,) int64: rows dropped, and those of them outside the bank. ``table`` (N, K) int32/int64,
    ``idx``, ``labels`` (B,) and ``centre_labels`` (N,) of any integer dtype, all CPU tensors;
    ``labels`` None: no label comparison (``counts[0]`` counts the rows outside the bank).
    None where this is not done here: the library unavailable, other dtypes or devices.

    One call where there were two (the lists, then the labels' count) on a bank loss's every
    CPU call, with the GPU's contract, so both devices take one route (losses/base.BankLoss).
    Its time is the table's rows read on cold caches, not the calls: a module's call was not
    measurably faster for it (2-core Intel Xeon, 2026-11-28)."""
    out = _batch_lists(table, idx, labels, centre_labels, exclude_self)
    return None if out is None else out[:2]


def _batch_lists(table, idx, labels, centre_labels, exclude_self: bool):
    """:func:`batch_lists`'s ``(lists, counts)`` and the rows dropped as an int (the library's
    answer: no read of ``counts``), or None."""
    lib = _lib()
    if (lib is None or table.device.type != "cpu" or table.dtype not in _INDEX_TYPES
            or table.dim() != 2 or idx.dim() != 1
            or any(t is not None and (t.device.type != "cpu" or t.is_floating_point()
                                      or t.is_complex() or t.dtype == torch.bool)
                   for t in (idx, labels, centre_labels))):
        return None
    N, K = table.shape
    B = idx.shape[0]
    if labels is not None and (labels.shape != (B,) or centre_labels.shape != (N,)):
        return None
    table = table.contiguous()
    idx = _index_tensor(idx)
    out = torch.empty(B, K, dtype=table.dtype)
    counts = torch.empty(2, dtype=torch.int64)
    lab = cl = None
    lab64 = cl64 = 0
    if labels is not None:
        lab, cl = _index_tensor(labels), _index_tensor(centre_labels)
        lab64, cl64 = _INDEX_TYPES[lab.dtype], _INDEX_TYPES[cl.dtype]
    dropped = lib.nnk_batch_lists(
        table.data_ptr(), _INDEX_TYPES[table.dtype], N, K, idx.data_ptr(),
        _INDEX_TYPES[idx.dtype], _ptr(lab), lab64, _ptr(cl), cl64, B, int(bool(exclude_self)),
        out.data_ptr(), counts.data_ptr())
    return out, counts, dropped


# Its counts are host memory: a bank loss reads them on every call (no sync), where those of
# the GPU's launcher are read only with the value checks on (losses/base.BankLoss).
batch_lists.host_counts = True


def _index_tensor(t):
    """An integer tensor as the library reads it: int32 / int64, contiguous (others as int64)."""
    if t.dtype not in _INDEX_TYPES:
        t = t.long()
    return t.contiguous()


def gather_lists(table, idx, exclude_self: bool):
    """The bank's lists of rows ``idx``: ``table[idx]`` (B, K) with each row's own index
    replaced by -1 when ``exclude_self``, in one pass (:func:`batch_lists` without labels; one
    call instead of torch's gather, compare and fill: 4 against 55 us at B 1024, K 32,
    measured 2026-11-24). ``table`` (N, K) and ``idx`` (B,) are CPU int32/int64 tensors,
    ``table`` contiguous. None where this is not done here: the library unavailable, other
    dtypes or devices, or an idx outside [0, N) (the caller's own check reports it)."""
    if (table.dtype not in _INDEX_TYPES or idx.dtype not in _INDEX_TYPES
            or not table.is_contiguous()):
        return None
    out = _batch_lists(table, idx, None, None, exclude_self)
    if out is None or out[2]:  # without labels, the rows dropped are those outside the bank
        return None
    return out[0]


def gather_read(bank, neighbours, nthreads: Optional[int] = None) -> Optional[int]:
    """The benchmarks' gather limit (``nnk_gather_read``): reads the rows of ``bank`` (N, D),
    any dtype, that ``neighbours`` (int32 / int64, -1 = padding) names, in their order, as the
    forward's first pass reads them, and nothing else; returns the XOR of the rows' 8-byte
    words (0 for none), a number the reads cannot be skipped for. ``nthreads``: default
    torch's count. None where the library is unavailable or the tensors are not contiguous CPU
    tensors of those types; entries outside [-1, N) raise."""
    lib = _lib()
    if (lib is None or not bank.is_cpu or not neighbours.is_cpu or bank.dim() != 2
            or not bank.is_contiguous() or neighbours.dtype not in _INDEX_TYPES):
        return None
    nb = neighbours.contiguous().reshape(-1)
    if nb.numel():
        lo, hi = (int(v) for v in torch.aminmax(nb))
        if lo < -1 or hi >= bank.shape[0]:
            raise IndexError(f"neighbours must lie in [-1, {bank.shape[0]}), got [{lo}, {hi}]")
    row_bytes = bank.shape[1] * bank.element_size()
    n = torch.get_num_threads() if nthreads is None else max(1, int(nthreads))
    return int(lib.nnk_gather_read(bank.data_ptr(), bank.shape[0], row_bytes, nb.data_ptr(),
                                   int(nb.dtype == torch.int64), nb.numel(), n))


def value_flags(emb, neighbours, weights):
    """The value checks' reads of CPU tensors in one call (``nnk_check_values``): ``(lo, hi,
    emb_bad, weights_bad)``, the smallest and largest list entry (0, 0 when there is none),
    whether emb holds a NaN or inf, whether weights (None: no weights) hold a negative value,
    NaN or inf. None where this does not apply: the library not loaded yet (a check never
    builds it), non-CPU or non-contiguous tensors, dtypes it does not read."""
    lib = _state["lib"]
    if (lib is None or not emb.is_cpu or not neighbours.is_cpu
            or emb.dtype not in _BANK_TYPES or neighbours.dtype not in _INDEX_TYPES
            or not emb.is_contiguous() or not neighbours.is_contiguous()
            or (weights is not None and (not weights.is_cpu or weights.dtype not in _BANK_TYPES
                                         or not weights.is_contiguous()))):
        return None
    out = (ctypes.c_int64 * 4)()
    rc = lib.nnk_check_values(
        neighbours.data_ptr(), int(neighbours.dtype == torch.int64), neighbours.numel(),
        emb.data_ptr(), _BANK_TYPES[emb.dtype], emb.numel(), _ptr(weights),
        _BANK_TYPES[weights.dtype] if weights is not None else 0,
        0 if weights is None else weights.numel(), out)
    if rc != 0:
        raise RuntimeError(f"nnk_check_values failed (code {rc})")
    return out[0], out[1], bool(out[2]), bool(out[3])


def counted_mean(per_row, counted):
    """``(mean, divisor)``: the sum of ``per_row`` divided by ``divisor = max(count, 1)``, the
    number of True entries of ``counted``; 0-dim tensors of per_row's dtype (``nnk_counted_mean``:
    one call in place of four torch ops). None where this is not done here: the library not
    loaded (a mean never builds it), non-CPU tensors, per_row not (B,) fp32/fp64 or counted
    not (B,) bool, either non-contiguous."""
    lib = _state["lib"]
    if (lib is None or not (per_row.is_cpu and counted.is_cpu)
            or per_row.dtype not in (torch.float32, torch.float64)
            or counted.dtype != torch.bool or per_row.dim() != 1
            or counted.shape != per_row.shape
            or not (per_row.is_contiguous() and counted.is_contiguous())):
        return None
    mean, divisor = per_row.new_empty(()), per_row.new_empty(())
    rc = lib.nnk_counted_mean(int(per_row.dtype == torch.float64), per_row.data_ptr(),
                              counted.data_ptr(), per_row.shape[0], mean.data_ptr(),
                              divisor.data_ptr())
    if rc != 0:
        raise RuntimeError(f"nnk_counted_mean failed (code {rc})")
    return mean, divisor


def gathered_rows_finite(centres, neighbours):
    """0-dim bool: every row of ``centres`` (N, D) that ``neighbours`` (any shape, -1 =
    padding) lists is finite, in one pass over the listed rows on the kernel's threads
    (``nnk_gathered_finite``: no gathered copy). Entries outside [0, N) are not read (the value
    checks report them, naming the index). None where this is not done here: the library not
    loaded yet (a value check never builds it), non-CPU tensors, a bank dtype it does not read,
    a non-contiguous bank."""
    lib = _state["lib"]
    if (lib is None or not (centres.is_cpu and neighbours.is_cpu) or centres.dim() != 2
            or centres.dtype not in _BANK_TYPES or neighbours.dtype not in _INDEX_TYPES
            or not centres.is_contiguous()):
        return None
    N, D = centres.shape
    flat = neighbours.detach().reshape(-1).contiguous()
    n = flat.numel()
    if n == 0 or N == 0 or D == 0:
        return torch.ones((), dtype=torch.bool)
    rc = _run("gathered_finite", n * D, lambda k: lib.nnk_gathered_finite(
        centres.data_ptr(), _BANK_TYPES[centres.dtype], N, D, flat.data_ptr(),
        _INDEX_TYPES[flat.dtype], n, k))
    if rc not in (0, 1):
        raise RuntimeError(f"nnk_gathered_finite failed (code {rc})")
    return torch.tensor(rc == 0)


def has_same_label(neighbours, centre_labels):
    """(N,) bool: list i of ``neighbours`` (N, K), -1 = padding, holds a row of label
    ``centre_labels[i]``, each row read up to its first such entry (``nnk_has_same_label``);
    None where this is not done here: the library unavailable, non-CPU, non-contiguous or
    non-int32/int64 tensors, a table whose rows are not the N centres. An entry read outside
    [-1, N) raises IndexError."""
    lib = _lib()
    if (lib is None or not (neighbours.is_cpu and centre_labels.is_cpu)
            or neighbours.dtype not in _INDEX_TYPES or centre_labels.dtype not in _INDEX_TYPES
            or neighbours.dim() != 2 or centre_labels.dim() != 1
            or neighbours.shape[0] != centre_labels.shape[0]
            or not (neighbours.is_contiguous() and centre_labels.is_contiguous())):
        return None
    N, K = neighbours.shape
    out = torch.empty(N, dtype=torch.bool)
    rc = lib.nnk_has_same_label(neighbours.data_ptr(), _INDEX_TYPES[neighbours.dtype], N, K,
                                centre_labels.data_ptr(), _INDEX_TYPES[centre_labels.dtype],
                                out.data_ptr())
    if rc == 3:
        raise IndexError(f"neighbours must hold rows in [0, {N}) or -1 (padding)")
    if rc != 0:
        raise RuntimeError(f"nnk_has_same_label failed (code {rc})")
    return out


def list_overlap(new, old, num_rows: int):
    """``(shared, listed)``, each (rows,) int64: how many entries of each list of ``new``
    (rows, K) its list in ``old`` (rows, K') also holds (-1 = padding, never shared; a repeated
    new entry counted each time) and how many are not padding, by the compiled library (``nnk_list_overlap``: a bitmap of the ``num_rows`` rows the lists
    index, O(K) a row); None where this is not done here: the library unavailable, non-CPU,
    non-contiguous or non-int32/int64 tensors, lists of different row counts, or an entry
    outside [-1, num_rows).

    ``num_rows`` must be an int >= 0 (TypeError / ValueError naming it): the library sizes its
    bitmap by it, and a negative count became a size_t of 2**64 - n, which aborted the process
    (std::length_error through the C interface); a bitmap too large to allocate is a
    MemoryError naming it."""
    num_rows = _index_arg("num_rows", num_rows)
    if (not (new.is_cpu and old.is_cpu) or new.dtype not in _INDEX_TYPES
            or old.dtype not in _INDEX_TYPES or new.dim() != 2 or old.dim() != 2
            or new.shape[0] != old.shape[0]
            or not (new.is_contiguous() and old.is_contiguous())):
        return None
    lib = _lib()
    if lib is None:
        return None
    rows = new.shape[0]
    out = torch.empty(2, rows, dtype=torch.int64)
    rc = lib.nnk_list_overlap(new.data_ptr(), _INDEX_TYPES[new.dtype], new.shape[1],
                              old.data_ptr(), _INDEX_TYPES[old.dtype], old.shape[1], rows,
                              num_rows, out[0].data_ptr(), out[1].data_ptr())
    if rc == 4:
        raise MemoryError(f"list_overlap: no memory for a bitmap of num_rows={num_rows} rows "
                          f"({(num_rows + 7) // 8} bytes)")
    return (out[0], out[1]) if rc == 0 else None


def forward_exp(x):
    """The exponential the compiled forward uses for its softmax (``vexp`` in
    cpu_kernel.cpp: vectorised, within ~1 ulp of exp), applied to an fp32 CPU tensor; for
    tests. None when the library is unavailable."""
    lib = _lib()
    if lib is None:
        return None
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty_like(x)
    lib.nnk_vexp(x.data_ptr(), out.data_ptr(), x.numel())
    return out


class KnnSelection:
    """The exact search's selection state for ``rows`` query rows (nnkloss/bank/search/
    torch_search.py): per row a buffer of ``cap`` uint64 keys ``(distance bits << 32) | index``,
    its fill count and the worst key kept at the last compaction; see the end of cpu_kernel.cpp.
    For a symmetric self-search the rows are all N points of the set (:meth:`add_symmetric`).
    """

    def __init__(self, lib, rows: int, k: int, cap: int):
        self.lib, self.k, self.cap = lib, int(k), int(cap)
        self.keys = torch.empty(rows, self.cap, dtype=torch.int64)
        self.count = torch.empty(rows, dtype=torch.int64)
        self.worst = torch.empty(rows, dtype=torch.int64)
        # No row is live before reset(): the buffers above are uninitialised, and an add()
        # on them would write keys at the garbage counts' offsets.
        self.rows = 0
        self._col_end = 0

    def reset(self, rows: int) -> None:
        """Start a selection of ``rows`` query rows (at most the rows allocated)."""
        rows = _index_arg("rows", rows)
        if not 0 <= rows <= self.keys.shape[0]:
            raise ValueError(f"rows must be in [0, {self.keys.shape[0]}] (the rows the state "
                             f"was allocated for), got {rows}")
        self.rows = rows
        self._col_end = 0
        self.count[:rows].zero_()
        self.worst[:rows].fill_(-1)  # UINT64_MAX: nothing kept yet

    def add(self, dist, col0: int) -> None:
        """Fold a (rows, cols) fp32 CPU tile of distances to base rows col0.. in: ``rows`` the
        rows of the last :meth:`reset`, unit column stride (row stride >= cols), tiles in
        ascending, non-overlapping column order, col0 + cols <= 2**32 (a key's index)."""
        # The library writes each tile row's keys into the state's row of that number and
        # reads rows * row stride floats from dist's pointer: a tile of more rows than the
        # state, of another dtype or device, or with strided columns would write past the
        # state's buffers or read past (or around) the tile's.
        _check_tile(dist, self.rows)
        rows, cols = dist.shape
        col0 = _index_arg("col0", col0)
        if col0 < self._col_end or col0 + cols > 1 << 32:
            # earlier columns would break the prefilter's ascending-index rule (and repeat
            # keys); indices past 2**32 do not fit a key's low half
            raise ValueError(f"col0 must be in [{self._col_end}, 2**32 - {cols}] (after the "
                             f"previous tile's columns; a key holds a 32-bit index), got {col0}")
        self._col_end = col0 + cols
        rc = _run("knn_select", rows * cols, lambda n: self.lib.nnk_knn_select(
            dist.data_ptr(), rows, cols, dist.stride(0), int(col0), self.k, self.cap,
            self.keys.data_ptr(), self.count.data_ptr(), self.worst.data_ptr(), n))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_select failed (code {rc})")

    def add_symmetric(self, dist, row0: int, col0: int) -> None:
        """Fold the (rows, cols) fp32 CPU tile (row stride ``dist.stride(0)``, unit column
        stride) of distances between points row0.. (query side) and col0.. (base side) of one
        point set into the rows' selections and, unless it is a diagonal tile (row0 == col0,
        rows == cols), into the columns' (``nnk_knn_select_sym``): the caller passes tiles so
        that every point's candidates arrive in ascending index order."""
        _check_tile(dist)
        rows, cols = dist.shape
        row0, col0 = _index_arg("row0", row0), _index_arg("col0", col0)
        if max(row0 + rows, col0 + cols) > self.rows:
            raise ValueError(f"tile rows {row0}..{row0 + rows} / columns {col0}..{col0 + cols} "
                             f"exceed the {self.rows} points of the state")
        rc = _run("knn_select", 2 * rows * cols, lambda n: self.lib.nnk_knn_select_sym(
            dist.data_ptr(), rows, cols, dist.stride(0), int(row0), int(col0), self.k,
            self.cap, self.keys.data_ptr(), self.count.data_ptr(), self.worst.data_ptr(), n))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_select_sym failed (code {rc})")

    def finish(self, row0: int = 0, rows: Optional[int] = None, self0: Optional[int] = None,
               out=None):
        """(rows, k) fp32 distances and int64 indices of state rows row0 .. row0 + rows - 1
        (default: all the rows of the last reset), ascending by (distance, index).

        ``self0``: the rows are points ``self0 ..`` of a self-search (the state selected
        ``k`` = the list length + 1): each row's own index leaves its list in the decode,
        as :func:`nnkloss.bank.search.drop_self` would take it out (the same result), and the
        lists are (rows, k - 1).

        The rows' buffers are padded past their counts with the largest key
        (``nnk_knn_pad``), sorted whole in place (:func:`sort_rows`: numpy's sort), and their
        first k keys decoded (``nnk_knn_unkey``). Keys are unique, so any sort gives the same
        lists; numpy's is SIMD on x86 (x86-simd-sort, AVX2 / AVX-512) and aarch64, and sorted
        the 1,000-3,000-key buffers 4-8x faster than the nth_element and std::sort of the k
        smallest it replaced (2026-11-27, the 2-core AMD EPYC family 26; docs/PERFORMANCE.md,
        "The kNN graph"). The state's rows are left sorted and padded: finish them once.

        ``out``: a (distances, indices) pair of contiguous (rows, k) fp32 / int64 CPU tensors
        (k - 1 columns with ``self0``) to decode into, e.g. rows of the caller's whole result:
        no block of its own then, and no copy of it (returned as given)."""
        rows = self.rows - row0 if rows is None else int(rows)
        if row0 < 0 or rows < 0 or row0 + rows > self.rows:
            raise ValueError(f"rows {row0}..{row0 + rows} outside the state's {self.rows}")
        if self0 is not None and (self0 < 0 or self.k < 2):
            raise ValueError(f"self0 must be >= 0 with a selection of k >= 2, got self0 "
                             f"{self0} and k {self.k}")
        k = self.k if self0 is None else self.k - 1
        keys = self.keys[row0:row0 + rows]
        rc = self.lib.nnk_knn_pad(rows, self.k, self.cap, keys.data_ptr(),
                                  self.count[row0:].data_ptr(),
                                  _governed_threads("knn_select", rows * self.cap))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_pad failed (code {rc}): a row holds fewer than k "
                               "keys")
        if out is None:
            dist = torch.empty(rows, k, dtype=torch.float32)
            idx = torch.empty(rows, k, dtype=torch.int64)
        else:
            dist, idx = out
            for t, dt in ((dist, torch.float32), (idx, torch.int64)):
                if (t.shape != (rows, k) or t.dtype != dt or t.device.type != "cpu"
                        or not t.is_contiguous()):
                    raise ValueError(f"out must hold contiguous ({rows}, {k}) fp32 and int64 "
                                     f"CPU tensors, got {tuple(t.shape)} {t.dtype} on "
                                     f"{t.device}")
        sort_rows(keys.numpy().view(np.uint64))
        rc = self.lib.nnk_knn_unkey(rows, k, self.cap, keys.data_ptr(), dist.data_ptr(),
                                    idx.data_ptr(), -1 if self0 is None else int(self0),
                                    _governed_threads("knn_select", rows * k))
        if rc != 0:
            raise RuntimeError(f"nnk_knn_unkey failed (code {rc})")
        return dist, idx


def _index_arg(name: str, v) -> int:
    """``v`` as an int >= 0, or TypeError / ValueError naming ``name``: it becomes a pointer
    offset in the library."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def _check_tile(dist, rows: Optional[int] = None) -> None:
    """A distance tile the selection's library may read through its pointer: a 2-D fp32 CPU
    tensor with unit column stride and a row stride of at least its columns (the library
    reads row r at r * stride(0)), of ``rows`` rows where given."""
    if not isinstance(dist, torch.Tensor):
        raise TypeError(f"dist must be a tensor, got {type(dist).__name__}")
    if dist.dim() != 2:
        raise ValueError(f"dist must be a 2-D (rows, cols) tile, got shape {tuple(dist.shape)}")
    r, c = dist.shape
    if (dist.dtype != torch.float32 or dist.device.type != "cpu"
            or (c > 1 and dist.stride(1) != 1) or (r > 1 and dist.stride(0) < c)):
        raise ValueError(f"dist must be an fp32 CPU tile with unit column stride and a row "
                         f"stride >= its columns, got {dist.dtype} on {dist.device}, strides "
                         f"{tuple(dist.stride())}")
    if rows is not None and r != rows:
        raise ValueError(f"dist has {r} rows but the selection was reset to {rows} rows")


def sort_rows(a) -> None:
    """Sort each row of the 2-D numpy array ``a`` in place, the rows shared out to the
    selection governor's count (at most torch's; one where it chose one) where each gets at
    least SORT_MIN_KEYS: numpy's sort (which releases the GIL)
    called back from the library's threads (``nnk_run_items``, torch's OpenMP team), or from
    Python threads where the library is unavailable. Python threads straight after one of the
    team's parallel regions (the search's GEMM and selection run just before) share the cores
    with its workers, which spin for milliseconds: two sorted a (2048, 3064) block no faster
    than one there (17 ms), and 1.8x faster 50 ms later (the 2-core AMD EPYC family 26)."""
    n_rows, width = a.shape
    n = min(_governed_threads("knn_select", n_rows * width, SORT_MIN_KEYS), max(n_rows, 1))
    if n == 1:
        a.sort(axis=1)
        return
    bounds = [n_rows * t // n for t in range(n + 1)]
    lib = _lib()
    if lib is None:
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda t: a[bounds[t]:bounds[t + 1]].sort(axis=1), range(n)))
        return
    errors = []

    def share(t):  # an exception cannot cross the C frames: kept, raised below
        try:
            a[bounds[t]:bounds[t + 1]].sort(axis=1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    rc = lib.nnk_run_items(n, n, _ITEM_CALLBACK(share))
    if errors:
        raise errors[0]
    if rc != 0:
        raise RuntimeError(f"nnk_run_items failed (code {rc})")


# The callback type of nnk_run_items: void fn(int64_t item).
_ITEM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int64)

# Keys a sorting thread gets at least (~0.1 ms of numpy's SIMD sort, well above a thread's
# start).
SORT_MIN_KEYS = 1 << 16


def gemm_nt(a, b, out, nthreads: Optional[int] = None) -> bool:
    """``out = a @ b.T`` by the library's GEMM (``nnk_gemm_nt`` in cpu_kernel.cpp: each element
    one fp32 dot product summed in column order with fused multiply-adds, the same bits whatever
    the shapes and threads), for fp32 CPU matrices with unit column strides, ``out`` (m, n) not
    overlapping the inputs. True when it ran; False where it cannot (the library unavailable or
    built without AVX-512, or another dtype, device or layout): the caller then uses torch.mm.
    Threads: the "gemm" governor's choice, or exactly ``nthreads`` (a benchmark's rate of the
    machine, which a governor's probe at one thread would halve).
    """
    lib = _lib()
    mats = (a, b, out)
    if (lib is None or any(t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2
                           for t in mats)
            or a.shape[1] != b.shape[1] or out.shape != (a.shape[0], b.shape[0])):
        return False
    lds = [_row_stride(t) for t in mats]
    if None in lds:
        return False
    m, k = a.shape
    n = b.shape[0]

    def call(t):
        return lib.nnk_gemm_nt(a.data_ptr(), lds[0], b.data_ptr(), lds[1], out.data_ptr(),
                               lds[2], m, n, k, t)
    rc = (call(max(1, int(nthreads))) if nthreads is not None
          else _run("gemm", m * n * max(k, 1), call, GEMM_MIN_MACS))
    if rc == 1:
        return False
    if rc != 0:
        raise RuntimeError(f"nnk_gemm_nt failed (code {rc})")
    return True


def _row_stride(t) -> Optional[int]:
    """The row stride of a 2-D tensor whose rows are unit-stride and do not overlap (what the
    library's GEMM reads and writes), or None."""
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1:
        return None
    if rows <= 1:
        return max(cols, 1)
    return t.stride(0) if t.stride(0) >= max(cols, 1) else None


# A GEMM thread's least share of multiply-adds (~5 us at one core's ~200 GFLOP/s), below which
# a parallel region would not repay itself.
GEMM_MIN_MACS = 1 << 20


def knn_selection(rows: int, k: int, cap: int) -> Optional[KnnSelection]:
    """A compiled selection state for ``rows`` query rows, or None when the library is
    unavailable (the search then runs its plain torch selection)."""
    lib = _lib()
    return None if lib is None else KnnSelection(lib, rows, k, cap)
