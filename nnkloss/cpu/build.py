"""Build, cache, verify and load the CPU library (``csrc/*.cpp``, no torch headers) with ctypes:
compiled once per machine into a private per-user cache keyed by sources, compiler, flags and CPU,
loaded only after its owner, mode and sha256 check out (docs/SECURITY.md). Any failure (or
``NNKLOSS_CPU_KERNEL=0``) leaves ``available()`` False: one warning, and callers run torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from typing import Optional

import torch

from ..atomic import atomic_write

__all__ = ["available", "build_info", "library_path", "cache_dir", "threads"]

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [os.path.join(CSRC, f) for f in ("op.cpp", "batch.cpp", "search.cpp")]
# -fno-trapping-math: the library never reads the FP exception flags, and without it GCC keeps
# the exponentials (vexp) scalar without AVX-512's masks; it changes no result.
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fno-trapping-math", "-shared", "-fPIC"]
# Where torch's intra-op pool is libgomp, the library runs on that same pool (one set of
# threads, never two spinning against each other); elsewhere on its own std::threads.
OPENMP_FLAGS = ["-pthread", "-fopenmp"]
THREAD_FLAGS = ["-pthread", "-fopenmp-simd"]
PLAIN_FLAGS = ["-pthread"]  # a compiler without -fopenmp-simd: the loops still auto-vectorise

BANK_TYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
INDEX_TYPES = {torch.int32: 0, torch.int64: 1}

_lock = threading.Lock()
_FRESH = {"lib": None, "tried": False, "error": None, "path": None, "compile_s": None,
          "warned": False, "pool": None}
_state = dict(_FRESH)


def _compiler() -> Optional[str]:
    names = (os.environ.get("NNKLOSS_CXX"), os.environ.get("CXX"), "c++", "g++", "clang++")
    return next(filter(None, (shutil.which(name) for name in names if name)), None)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("NNKLOSS_CACHE_DIR") or os.path.join(base, "nnkloss")


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
    for name in _source_files():
        with open(name, "rb") as f:
            h.update(os.path.basename(name).encode() + b"\0" + f.read())
    for part in (cxx, version, " ".join(flags), _cpu_flags(), platform.machine()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _source_files() -> list:
    """SOURCES and the headers beside them: everything the library is built from."""
    d = os.path.dirname(SOURCES[0])  # one folder (a benchmark builds another revision's)
    return SOURCES + sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".h"))


class _Untrusted(Exception):
    """A cached library (or its recorded checksum) that must not be loaded: rebuild it."""


def _private_dir(d: str) -> str:
    """``d`` if this user owns it and neither group nor others can write to it (created with mode
    0700 when missing; another user could plant a library there); otherwise OSError why."""
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
    """The first private one of cache_dir() and ``<tmp>/nnkloss-<uid>``, else RuntimeError why."""
    reasons = []
    for d in (cache_dir(), os.path.join(tempfile.gettempdir(), f"nnkloss-{os.getuid()}")):
        try:
            return _private_dir(d)
        except OSError as exc:
            reasons.append(str(exc) if not exc.filename else f"{d}: {exc.strerror}")
    raise RuntimeError("no private cache directory (" + "; ".join(reasons) + ")")


def _sha256_of(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_owned(path: str):
    """``path`` open for reading (never through a symlink) once its descriptor shows a regular
    file of this user's that group and others cannot write; _Untrusted otherwise."""
    try:
        f = os.fdopen(os.open(path, _OPEN_FLAGS), "rb")
    except OSError as exc:
        raise _Untrusted(f"{path}: {exc.strerror}") from None
    st = os.fstat(f.fileno())
    for bad, why in ((not stat.S_ISREG(st.st_mode), "is not a regular file"),
                     (st.st_uid != os.geteuid(), f"is owned by uid {st.st_uid}, not by this user"),
                     (st.st_mode & 0o022, "is writable by group or others")):
        if bad:
            f.close()
            raise _Untrusted(f"{path} {why}")
    return f


def _recorded_sha256(path: str) -> str:
    """The sha256 written beside ``path`` at build time (the record passes the owner checks)."""
    with _open_owned(path + ".sha256") as f:
        text = f.read(100).decode("ascii", "replace").strip()
    if len(text) != 64 or text.strip("0123456789abcdef"):
        raise _Untrusted(f"{path}.sha256 does not hold a sha256")
    return text


def _open_verified(path: str) -> int:
    """A file descriptor open on ``path`` once its owner, mode and sha256 have been checked on
    that same descriptor (what gets loaded is what was checked); _Untrusted otherwise."""
    expected = _recorded_sha256(path)
    with _open_owned(path) as f:
        if _sha256_of(f) != expected:
            raise _Untrusted(f"{path} does not match the sha256 recorded when it was built "
                             "(truncated or modified)")
        return os.dup(f.fileno())  # the same open file, past the closing of f


def _compile(cxx: str, flags, out_dir: str) -> str:
    """Compile to a temporary file in ``out_dir``, fsync it, rename it to its keyed name and
    record its sha256 beside it; a library already there is reused only if it verifies."""
    path = os.path.join(out_dir, f"nnk_cpu_{_cache_key(cxx, flags)}.so")
    try:
        os.close(_open_verified(path))
        return path
    except _Untrusted:
        pass  # build it afresh; the rename below replaces whatever is there
    fd, tmp = tempfile.mkstemp(prefix=".nnk_cpu_", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, *SOURCES, "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:  # the first line with "error", else the last, else "?"
            lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
            first = next((line for line in lines if "error" in line), lines[-1] if lines else "?")
            raise RuntimeError(f"{os.path.basename(cxx)} failed: {first}")
        os.chmod(tmp, 0o755)  # whatever the umask: group/other-writable would be refused
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes reach the disk before the name does
            digest = _sha256_of(f)
        os.replace(tmp, path)  # atomic: a racing process sees the old name or the whole file
        # After the rename: a racing reader with an older record rebuilds, never loads.
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
    signatures = {  # name: (restype, argtypes)
        "nnk_forward": (I, [I, I, P, P, I, P, P, I, P, I, P, I, D, I64, I64, I64, I64, I, P, P,
                            P, P, P, P, P, P, I]),
        "nnk_centre_grad": (I, [I, I, P, P, P, I, P, I64, I64, I64, I64, P, I]),
        "nnk_scale_rows": (I, [I, P, P, I64, P, P, I64, I64, P, I]),
        "nnk_entry_grads": (I, [I, P, P, I, P, I, P, I, P, I, P, P, P, I64, I64, I64, I64, D, P,
                                P, P, I]),
        "nnk_rel_sqdist": (I, [I, I, P, P, I64, P, P, I64, I64, I64, P, I]),
        "nnk_batch_lists": (I64, [P, I, I64, I64, P, I, P, I, P, I, I64, I, P, P]),
        "nnk_has_same_label": (I, [P, I, I64, I64, P, I, P]),
        "nnk_list_overlap": (I, [P, I, I64, P, I, I64, I64, I64, P, P]),
        "nnk_gathered_finite": (I, [P, I, I64, I64, P, I, I64, I]),
        "nnk_gather_read": (ctypes.c_uint64, [P, I64, I64, P, I, I64, I]),
        "nnk_check_values": (I, [P, I, I64, P, I, I64, P, I, I64, P]),
        "nnk_vexp": (I, [P, P, I64]),
        "nnk_knn_select": (I, [P, I64, I64, I64, I64, I64, I64, P, P, P, I]),
        "nnk_knn_select_sym": (I, [P, I64, I64, I64, I64, I64, I64, I64, P, P, P, I]),
        "nnk_knn_pad": (I, [I64, I64, I64, P, P, I]),
        "nnk_knn_unkey": (I, [I64, I64, I64, P, P, P, I64, I]),
        "nnk_gemm_nt": (I, [P, I64, P, I64, P, I64, I64, I64, I64, I]),
        "nnk_run_items": (I, [I64, I, ITEM_CALLBACK]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)  # AttributeError: a library without one of the symbols
        fn.restype, fn.argtypes = restype, argtypes
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
    """The libgomp torch's intra-op pool runs on, if its parallel backend is OpenMP: the
    ``libgomp.so.1`` in torch's lib directory, else the only libgomp loaded; None otherwise.
    Renamed copies (``libgomp-<hash>.so``) have other sonames, so -fopenmp binds to torch's."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    found = _loaded_libgomp()
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    return next((path for path in found if os.path.basename(path) == "libgomp.so.1"
                 and os.path.dirname(os.path.realpath(path)) == torch_lib),
                found[0] if len(found) == 1 else None)


def flag_choices() -> list:
    """The thread flags tried in order, each after FLAGS (torch's OpenMP team first)."""
    return ([OPENMP_FLAGS] if torch_libgomp() else []) + [THREAD_FLAGS, PLAIN_FLAGS]


# The callback type of nnk_run_items: void fn(int64_t item).
ITEM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int64)


def lib():
    """The loaded library, built on the first call; None where it is unavailable."""
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            try:
                _state["lib"] = _build_and_load()
            except Exception as exc:  # any failure: the plain torch path runs instead
                _state["error"] = str(exc)
            _state["tried"] = True
            spent = _state["compile_s"]  # over a second: a compile, not a cached load
            if _state["lib"] is not None and (spent or 0.0) >= 1.0:
                logging.getLogger("nnkloss").warning(
                    "nnkloss: compiled the CPU kernel in %.1f s (once per machine; cached in %s)",
                    spent, os.path.dirname(_state["path"]))
    if _state["lib"] is None and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(f"nnkloss: compiled CPU kernel unavailable ({_state['error']}); "
                      "using the plain PyTorch path", RuntimeWarning, stacklevel=3)
    return _state["lib"]


def available() -> bool:
    """True when the compiled CPU kernel is built and loaded (builds it on the first call)."""
    return lib() is not None


def build_info() -> dict:
    """Library path, build/load seconds of this process's first call, error, and whose
    threads the kernel runs on ("torch-openmp": torch's OpenMP team; "own-threads")."""
    lib()
    return {k: _state[k] for k in ("path", "compile_s", "error", "pool")}


def library_path() -> Optional[str]:
    return build_info()["path"]


def _reset_for_tests():
    with _lock:
        _state.update(_FRESH)


# Each thread gets at least this many elements of work (the op's gathered B*K*D).
PARALLEL_MIN_ELEMS = 1 << 16


def threads(work: int, min_elems: Optional[int] = None) -> int:
    """torch's thread count, but at most one thread per ``min_elems`` (default
    PARALLEL_MIN_ELEMS) elements of ``work``, and at least one."""
    return max(1, min(torch.get_num_threads(), work // (min_elems or PARALLEL_MIN_ELEMS)))


def ptr(t) -> Optional[int]:
    """A tensor's data pointer for the library, None for None."""
    return None if t is None else t.data_ptr()
