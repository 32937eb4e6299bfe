"""The CPU library's build, cache and trust checks (nnkloss/cpu/build.py): what is compiled,
where it is cached, what is loaded and what is refused."""
import os
import threading
import time
import warnings

import pytest
import torch

from nnkloss import cpu
from nnkloss.cpu import build
from cases import in_fresh_process, list_case

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback tests below check the notice
    kernel = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: fallback only")


make = list_case  # tests/cases.py


@kernel
def test_build_is_atomic_when_processes_race(tmp_path):
    cxx = build._compiler()
    paths, errors = [], []

    def compile_once():
        try:
            paths.append(build._compile(cxx, build.FLAGS + build.THREAD_FLAGS, str(tmp_path)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=compile_once) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    name = os.path.basename(paths[0])                   # no temporary left behind
    assert sorted(os.listdir(tmp_path)) == [name, name + ".sha256"]
    os.close(build._open_verified(paths[0]))              # the library matches its record


@pytest.fixture
def fresh_state():
    build._reset_for_tests()
    yield
    build._reset_for_tests()


def test_without_compiler_warns_once_and_runs_torch_path(monkeypatch, fresh_state):
    monkeypatch.setattr(build, "_compiler", lambda: None)
    inputs = make(seed=11)
    with pytest.warns(RuntimeWarning, match="compiled CPU kernel unavailable"):
        assert not cpu.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # the notice is given once
        out = cpu.forward(*inputs)
        grad = cpu.centre_grad(inputs[0], inputs[2], inputs[4], torch.ones(9, 7))
    from nnkloss.ops import reference as torch_path
    ref = torch_path.forward(*inputs)
    for a, b in zip(out[:4], ref[:4]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(grad, torch_path.centre_grad(inputs[0], inputs[2], inputs[4],
                                                            torch.ones(9, 7)))
    gx, g = torch.randn(4, 3), torch.tensor([1.0, 0.0, -2.0, 0.5])
    gx[1, 0] = float("nan")
    assert torch.equal(cpu.scale_rows(gx, g), torch.where((g != 0)[:, None], g[:, None] * gx, 0.0))


def test_missing_compiler_binary_is_reported(monkeypatch, fresh_state, tmp_path):
    monkeypatch.setenv("NNKLOSS_CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(no C\+\+ compiler found \(set CXX\)\); "
                                            r"using the plain PyTorch path"):
        assert not cpu.available()


def test_kernel_can_be_switched_off(monkeypatch, fresh_state):
    monkeypatch.setenv("NNKLOSS_CPU_KERNEL", "0")
    with pytest.warns(RuntimeWarning, match=r"unavailable \(disabled by NNKLOSS_CPU_KERNEL=0\)"):
        assert not cpu.available()


def test_thread_count_rule(monkeypatch):
    """One thread per PARALLEL_MIN_ELEMS gathered elements, at least one, at most torch's."""
    m = build.PARALLEL_MIN_ELEMS
    assert m == 1 << 16
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert [build.threads(w) for w in (0, 1, m - 1, m, 2 * m - 1, 3 * m, 8 * m, 100 * m)] == \
        [1, 1, 1, 1, 1, 3, 8, 8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert build.threads(100 * m) == 1


def test_cache_dir_follows_the_documented_variables(monkeypatch, tmp_path):
    """``$NNKLOSS_CACHE_DIR``, else ``$XDG_CACHE_HOME/nnkloss``, else ``~/.cache/nnkloss``."""
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", "")            # empty = unset
    assert build.cache_dir() == str(tmp_path / "xdg" / "nnkloss")
    monkeypatch.delenv("NNKLOSS_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_dir() == str(tmp_path / "home" / ".cache" / "nnkloss")


def _check_library_works(tol=1e-5):
    from nnkloss.ops import reference as torch_path
    inputs = make(seed=23)
    for a, b in zip(cpu.forward(*inputs), torch_path.forward(*inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    emb, _, centres, _, nb, _, _ = inputs
    coef = torch.rand(nb.shape)
    torch.testing.assert_close(cpu.centre_grad(emb, centres, nb, coef),
                               torch_path.centre_grad(emb, centres, nb, coef), rtol=tol, atol=tol)
    gx, g = torch.randn(4, 3), torch.tensor([1.0, 0.0, -2.0, 0.5])
    assert torch.equal(cpu.scale_rows(gx, g), g[:, None] * gx)


@kernel
def test_fresh_build_into_an_empty_cache(monkeypatch, fresh_state, tmp_path):
    """The whole first-use path, not the library this process loaded long ago: the cache
    directory is created, one keyed library lands in it, it is declared and loaded, and
    build_info reports it (each of forward, centre_grad and scale_rows then runs on it)."""
    cache = tmp_path / "a" / "cache"
    cache.mkdir(parents=True)                           # an existing, empty cache directory
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no fallback notice
        assert cpu.available()
    wall = time.perf_counter() - t0
    info = cpu.build_info()
    assert info["error"] is None
    name = os.path.basename(info["path"])
    assert sorted(os.listdir(cache)) == [name, name + ".sha256"]   # the library and its record
    assert os.path.dirname(info["path"]) == str(cache) and cpu.library_path() == info["path"]
    assert os.path.basename(info["path"]).startswith("nnk_cpu_")
    assert 0 < info["compile_s"] <= wall
    _check_library_works()
    assert cpu.available()                              # a second call reuses the library


@kernel
def test_build_falls_back_to_plain_flags_then_to_a_temp_dir(monkeypatch, fresh_state, tmp_path):
    """A compiler that refuses -fopenmp-simd gets the plain flags; an unusable cache directory
    gives way to <tmp>/nnkloss-<uid>. (``_compile`` is replaced by a stand-in that hands back
    the library already built, so no second compile is needed.)"""
    built = cpu.library_path()
    build._reset_for_tests()                              # forget it: the next call builds
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(blocker / "cache"))   # cannot be created
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    out_dir = str(tmp_path / "tmp" / f"nnkloss-{os.getuid()}")
    os.makedirs(out_dir)                                # left by an earlier process
    calls = []

    def fake_compile(cxx, flags, out_dir):
        calls.append((cxx, flags, out_dir))
        for flag in ("-fopenmp", "-fopenmp-simd"):
            if flag in flags:
                raise RuntimeError(f"c++ failed: unknown flag {flag}")
        return built
    monkeypatch.setattr(build, "_compile", fake_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available()
    first = [build.OPENMP_FLAGS] if build.torch_libgomp() else []   # torch's OpenMP team first
    assert calls == [(build._compiler(), build.FLAGS + f, out_dir)
                     for f in first + [build.THREAD_FLAGS, build.PLAIN_FLAGS]]
    assert os.path.isdir(out_dir) and cpu.build_info()["path"] == built
    _check_library_works()


def test_build_failure_reports_every_attempt(monkeypatch, fresh_state, tmp_path):
    real_compile = build._compile
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(tmp_path))

    def failing(cxx, flags, out_dir):
        raise RuntimeError(f"refused {flags[-1]}")
    monkeypatch.setattr(build, "_compile", failing)
    attempts = ("refused -fopenmp; " if build.torch_libgomp() else "") + \
        "refused -fopenmp-simd; refused -pthread"
    with pytest.warns(RuntimeWarning, match=r"unavailable \(" + attempts + r"\); using the "
                                            r"plain PyTorch path"):
        assert not cpu.available()
    assert cpu.build_info() == {"path": None, "compile_s": None, "error": attempts,
                                "pool": None}
    if build._compiler() is not None:
        # a reset forgets the failure: the next call builds (from the cache) and says so
        monkeypatch.setattr(build, "_compile", real_compile)
        monkeypatch.delenv("NNKLOSS_CACHE_DIR")
        build._reset_for_tests()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.available()
        info = cpu.build_info()
        assert info["error"] is None and os.path.exists(info["path"]) and info["compile_s"] > 0


def _fake_compiler(path, log=None, version="fakecxx 1.0", stderr=(), write=None):
    """An executable standing in for c++: answers --version, logs its arguments one per line,
    prints ``stderr`` lines and fails, or writes ``write`` to its -o file and succeeds."""
    lines = ["#!/bin/sh",
             f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi']
    if log:
        lines.append(f'for a in "$@"; do echo "$a"; done > "{log}"')
    if write is not None:
        lines += ['out=""; prev=""',
                  'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done',
                  f'printf "{write}" > "$out"', "exit 0"]
    else:
        lines += [f'echo "{s}" >&2' for s in stderr] + ["exit 1"]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return str(path)


def test_compiler_lookup_order(monkeypatch, tmp_path):
    """``$NNKLOSS_CXX``, then ``$CXX``, then c++, g++, clang++ on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("mine", "theirs", "c++", "g++", "clang++"):
        _fake_compiler(bin_dir / name)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("NNKLOSS_CXX", "mine")
    monkeypatch.setenv("CXX", "theirs")
    assert build._compiler() == str(bin_dir / "mine")
    monkeypatch.delenv("NNKLOSS_CXX")
    assert build._compiler() == str(bin_dir / "theirs")
    monkeypatch.delenv("CXX")
    for name in ("c++", "g++", "clang++"):
        assert build._compiler() == str(bin_dir / name)
        (bin_dir / name).unlink()
    assert build._compiler() is None


def test_cpu_flags_are_the_feature_list():
    """The CPU's feature list keys the cache (-march=native code must not be loaded on another
    CPU): the flags of /proc/cpuinfo on Linux, without the field name."""
    flags = build._cpu_flags()
    assert ":" not in flags and flags == flags.strip()
    if os.path.exists("/proc/cpuinfo") and build.platform.machine() == "x86_64":
        assert "sse2" in flags.split()             # every x86-64 CPU has it


def test_cache_key_follows_compiler_version_and_flags(tmp_path):
    a = _fake_compiler(tmp_path / "a", version="fakecxx 1.0")
    key = build._cache_key(a, build.FLAGS)
    assert len(key) == 20 and int(key, 16) >= 0
    assert build._cache_key(a, build.FLAGS) == key                     # deterministic
    assert build._cache_key(a, build.FLAGS + ["-g"]) != key            # flags
    _fake_compiler(tmp_path / "a", version="fakecxx 2.0")
    assert build._cache_key(a, build.FLAGS) != key                     # compiler version
    missing = build._cache_key(str(tmp_path / "none"), build.FLAGS)    # no --version: still a key
    assert len(missing) == 20


def test_compile_stages_a_hidden_file_and_reports_the_error_line(tmp_path):
    """The compiler writes to a hidden ``.nnk_cpu_*.so`` beside the target, renamed into place
    on success and removed on failure; a failure names the compiler and its first stderr line
    with "error" (else its last line)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    log = tmp_path / "args"
    bad = _fake_compiler(tmp_path / "fakecxx", log=log,
                         stderr=["note: a", "note: b", "error: boom"])
    with pytest.raises(RuntimeError, match=r"^fakecxx failed: error: boom$"):
        build._compile(bad, build.FLAGS, str(out_dir))
    args = log.read_text().splitlines()
    assert args[:len(build.FLAGS)] == build.FLAGS and args[-len(build.SOURCES) - 2:-1] == [*build.SOURCES, "-o"]
    staged = args[-1]
    assert os.path.dirname(staged) == str(out_dir)
    assert os.path.basename(staged).startswith(".nnk_cpu_") and staged.endswith(".so")
    assert os.listdir(out_dir) == []                               # staging file removed

    silent = _fake_compiler(tmp_path / "quiet", stderr=[])
    with pytest.raises(RuntimeError, match=r"^quiet failed: \?$"):
        build._compile(silent, build.FLAGS, str(out_dir))
    # GCC's shape: the error line, then the source line and its caret line
    gcc = _fake_compiler(tmp_path / "gcclike", stderr=[
        "k.cpp: In function 'void f()':", "k.cpp:3:5: error: 'y' was not declared",
        "    3 |     y = 1;", "      |     ^", "k.cpp:4:5: error: second"])
    with pytest.raises(RuntimeError,
                       match=r"^gcclike failed: k.cpp:3:5: error: 'y' was not declared$"):
        build._compile(gcc, build.FLAGS, str(out_dir))
    warned = _fake_compiler(tmp_path / "warned", stderr=["warning: a", "collect2: ld returned 1"])
    with pytest.raises(RuntimeError, match=r"^warned failed: collect2: ld returned 1$"):
        build._compile(warned, build.FLAGS, str(out_dir))

    good = _fake_compiler(tmp_path / "good", write="ELF")
    path = build._compile(good, build.FLAGS, str(out_dir))
    assert path == str(out_dir / f"nnk_cpu_{build._cache_key(good, build.FLAGS)}.so")
    name = os.path.basename(path)
    assert sorted(os.listdir(out_dir)) == [name, name + ".sha256"]
    with open(path) as f:
        assert f.read() == "ELF"
    assert os.stat(path).st_mode & 0o777 == 0o755
    record = open(path + ".sha256").read()
    assert record == __import__("hashlib").sha256(b"ELF").hexdigest() + "\n"
    inode = os.stat(path).st_ino
    assert build._compile(good, build.FLAGS, str(out_dir)) == path     # verified: reused
    assert os.stat(path).st_ino == inode                           # (a rebuild renames anew)
    # A library changed after its build (here: rewritten) no longer matches its record: it is
    # rebuilt, never reused (before issue 18 this test asserted the opposite).
    with open(path, "w") as f:
        f.write("OLD")
    assert build._compile(good, build.FLAGS, str(out_dir)) == path
    with open(path) as f:
        assert f.read() == "ELF"


# ---------------------------------------------------------------- nothing loaded unchecked
# (issue 18). A stand-in compiler that copies a given library to its -o file makes a "build"
# instant, so these tests can build as often as they need, in fresh processes too.

def _copy_compiler(path, lib, log=None):
    lines = ["#!/bin/sh", 'if [ "$1" = "--version" ]; then echo "copycxx 1.0"; exit 0; fi']
    if log:
        lines.append(f'echo built >> "{log}"')
    lines += ['out=""; prev=""',
              'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done',
              f'cp "{lib}" "$out"']
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return str(path)


def _key_path(cache, cxx, flags=None):
    key = build._cache_key(cxx, flags or build.FLAGS + build.flag_choices()[0])
    return os.path.join(str(cache), f"nnk_cpu_{key}.so")


def _record(path):
    import hashlib
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(path + ".sha256", "w") as f:
        f.write(digest + "\n")


def _compile_c(tmp_path, name, source):
    c = tmp_path / f"{name}.c"
    c.write_text(source)
    out = tmp_path / f"{name}.so"
    import subprocess
    subprocess.run([build._compiler(), "-shared", "-fPIC", "-x", "c", str(c), "-o", str(out)],
                   check=True, capture_output=True)
    return str(out)


def _evil_library(tmp_path):
    """(marker, library, compiler): a library whose constructor creates ``marker``, and a copy
    of the compiler that built the real library (so that the cache key is the real one's)."""
    marker = tmp_path / "pwned"
    evil = _compile_c(tmp_path, "evil", "#include <stdio.h>\n"
                      "__attribute__((constructor)) static void run(void) {\n"
                      f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    return marker, evil, _copy_compiler(tmp_path / "copycxx", cpu.library_path())


_REPORT = ("import warnings, json\n"
           "warnings.simplefilter('ignore')\n"
           "from nnkloss import cpu\nfrom nnkloss.cpu import build\n"
           "print(json.dumps([cpu.available(), cpu.build_info()]))\n")


@kernel
def test_truncated_library_is_rebuilt_never_loaded(tmp_path):
    """Cut to 25/50/75 % (what a power loss before the rename could leave, with or without its
    record), the cached library is rebuilt; before issue 18 ctypes mapped it and the process
    died of SIGBUS."""
    real = cpu.library_path()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cxx = _copy_compiler(tmp_path / "copycxx", real)
    target = _key_path(cache, cxx)
    data = open(real, "rb").read()
    code = ("import warnings, json, os\n"
            "warnings.simplefilter('ignore')\n"
            "from nnkloss import cpu\nfrom nnkloss.cpu import build\n"
            "out = []\n"
            f"target, data = {target!r}, open({real!r}, 'rb').read()\n"
            "for frac, keep_record in ((0.25, True), (0.5, False), (0.75, True)):\n"
            "    build._reset_for_tests()\n"
            # a new file: cutting the one the last trial loaded would hit its live mapping
            "    os.unlink(target)\n"
            "    with open(target, 'wb') as f:\n"
            "        f.write(data[:int(len(data) * frac)])\n"
            "    if not keep_record and os.path.exists(target + '.sha256'):\n"
            "        os.unlink(target + '.sha256')\n"
            "    out.append([cpu.available(), open(target, 'rb').read() == data])\n"
            "print(json.dumps(out))\n")
    with open(target, "wb") as f:
        f.write(data)
    _record(target)                                   # the record of the complete library
    proc = in_fresh_process(code, {"NNKLOSS_CACHE_DIR": str(cache), "NNKLOSS_CXX": cxx})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    import json
    assert json.loads(proc.stdout.splitlines()[-1]) == [[True, True]] * 3


@kernel
def test_planted_library_in_a_shared_cache_never_runs(tmp_path):
    """A world-writable cache directory (or one owned by someone else) is not used: a library
    planted there under the computable key, with a matching record, never runs its
    constructor; the kernel is built in the private fallback directory instead."""
    marker, evil, cxx = _evil_library(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                               # like a shared /tmp directory
    planted = _key_path(shared, cxx)
    import shutil
    shutil.copy(evil, planted)
    _record(planted)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = in_fresh_process(_REPORT, {"NNKLOSS_CACHE_DIR": str(shared), "NNKLOSS_CXX": cxx,
                                       "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not marker.exists()
    import json
    ok, info = json.loads(proc.stdout.splitlines()[-1])
    assert ok and os.path.dirname(info["path"]) == str(tmp / f"nnkloss-{os.getuid()}")


@kernel
@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file owned by another user needs root")
def test_foreign_library_or_directory_is_refused(tmp_path):
    """A library (or its record) owned by another user is rebuilt, even in our own private
    directory; a cache directory owned by another user is not used at all."""
    marker, evil, cxx = _evil_library(tmp_path)
    import shutil
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = _key_path(cache, cxx)
    shutil.copy(evil, planted)
    _record(planted)
    os.chown(planted, 65534, 65534)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    shutil.copy(evil, _key_path(theirs, cxx))
    _record(_key_path(theirs, cxx))
    os.chown(theirs, 65534, 65534)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    import json
    for d, where in ((cache, cache), (theirs, tmp / f"nnkloss-{os.getuid()}")):
        proc = in_fresh_process(_REPORT, {"NNKLOSS_CACHE_DIR": str(d), "NNKLOSS_CXX": cxx,
                                           "TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        ok, info = json.loads(proc.stdout.splitlines()[-1])
        assert ok and os.path.dirname(info["path"]) == str(where)
        assert not marker.exists()
    assert os.stat(planted).st_uid == os.geteuid()            # replaced by our own build
    assert open(planted, "rb").read() == open(cpu.library_path(), "rb").read()


@kernel
def test_writable_library_is_rebuilt(monkeypatch, fresh_state, tmp_path):
    """A library of ours that group or others may write to is not trusted: rebuilt."""
    real = cpu.library_path()
    log = tmp_path / "log"
    cxx = _copy_compiler(tmp_path / "copycxx", real, log=log)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = _key_path(cache, cxx)
    import shutil
    shutil.copy(real, target)
    _record(target)
    os.chmod(target, 0o777)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    monkeypatch.setenv("NNKLOSS_CXX", cxx)
    build._reset_for_tests()                              # forget the library found above
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available()
    assert log.read_text().splitlines() == ["built"]
    assert os.stat(target).st_mode & 0o777 == 0o755
    _check_library_works()


def test_no_private_cache_directory_runs_the_plain_path(monkeypatch, fresh_state, tmp_path):
    """Neither the configured directory nor <tmp>/nnkloss-<uid> private: a one-line warning
    naming both and why, then the plain path (nothing built, nothing loaded)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(shared))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback = tmp_path / "tmp" / f"nnkloss-{os.getuid()}"
    fallback.mkdir(parents=True)
    fallback.chmod(0o775)
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("must not build"))
    with pytest.warns(RuntimeWarning, match=r"no private cache directory \(.*shared is writable "
                                            r"by group or others \(mode 0o777\); .*nnkloss-\d+ is "
                                            r"writable by group or others"):
        assert not cpu.available()
    inputs = make(seed=11)
    from nnkloss.ops import reference as torch_path
    for a, b in zip(cpu.forward(*inputs)[:4], torch_path.forward(*inputs)[:4]):
        torch.testing.assert_close(a, b)


def test_missing_cache_directory_is_created_private(tmp_path):
    d = tmp_path / "a" / "b"
    assert build._private_dir(str(d)) == str(d)
    assert os.stat(d).st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        build._private_dir(str(tmp_path / "file"))


@kernel
def test_library_without_the_kernel_symbols_falls_back(monkeypatch, fresh_state, tmp_path):
    """A library that loads but lacks an entry point: each flag set is tried, and the failure
    is the one-line warning, not an AttributeError (which used to skip the second attempt)."""
    empty = _compile_c(tmp_path, "empty", "int nothing_here(void) { return 0; }\n")
    cxx = _copy_compiler(tmp_path / "copycxx", empty)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NNKLOSS_CACHE_DIR", str(cache))
    monkeypatch.setenv("NNKLOSS_CXX", cxx)
    with pytest.warns(RuntimeWarning, match=r"unavailable \(.*nnk_forward.*; .*nnk_forward.*\); "
                                            r"using the plain PyTorch path"):
        assert not cpu.available()


def test_library_is_fsynced_before_the_rename(monkeypatch, tmp_path):
    """The bytes reach the disk before the name: fsync of the staged file, then os.replace."""
    good = _fake_compiler(tmp_path / "good", write="ELF")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a)))
        return real_replace(a, b)
    monkeypatch.setattr(build.os, "fsync", fsync)
    monkeypatch.setattr(build.os, "replace", replace)
    build._compile(good, build.FLAGS, str(tmp_path))
    staged = [e for e in events if e[1].endswith(".so") and "/.nnk_cpu_" in e[1]]
    assert staged[0][0] == "fsync" and staged[1] == ("replace", staged[0][1])


def test_first_build_says_so_once(monkeypatch, fresh_state, caplog):
    """A compile (slow) gives one log line per process; a cached load (fast) gives none."""
    import logging
    monkeypatch.setattr(build, "_build_and_load", lambda: (
        build._state.update(path="/cache/x/nnk_cpu_1.so", compile_s=6.5), object())[1])
    with caplog.at_level(logging.INFO, logger="nnkloss"):
        build.lib()
        build.lib()
        cpu.available()
    lines = [r.getMessage() for r in caplog.records if r.name == "nnkloss"]
    assert lines == ["nnkloss: compiled the CPU kernel in 6.5 s (once per machine; cached in "
                     "/cache/x)"]
    build._reset_for_tests()
    monkeypatch.setattr(build, "_build_and_load", lambda: (
        build._state.update(path="/cache/x/nnk_cpu_1.so", compile_s=0.01), object())[1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nnkloss"):
        build.lib()
    assert [r for r in caplog.records if r.name == "nnkloss"] == []


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_cpu_library_is_built_once_per_process(monkeypatch):
    """Kills build.lib's mutants that leave the "tried" flag unset (every call rebuilt and
    reloaded the library)."""
    builds = []
    real = build._build_and_load

    def counting():
        builds.append(1)
        return real()
    monkeypatch.setattr(build, "_build_and_load", counting)
    build._reset_for_tests()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # no compiler: the notice is not the point
            first = cpu.available()
            assert [cpu.available() for _ in range(3)] == [first] * 3
    finally:
        build._reset_for_tests()
    assert builds == [1]
