"""The architecture as users meet it: a light import, the public names, the bank-loss contract."""
# Cross-cutting suite (CROSS_CUTTING below): the architecture and the layout of these tests.
import os
import subprocess
import sys

import pytest

import nnkloss


def test_import_is_light_and_the_core_never_imports_the_experiment_kit():
    code = ("import sys, nnkloss, nnkloss.ops, nnkloss.losses, nnkloss.bank, nnkloss.evaluation\n"
            "import nnkloss.distributed, nnkloss.bank.exchange\n"
            "bad = [m for m in sys.modules if m.startswith('nnkloss.experiment')\n"
            "       or m.split('.')[0] in\n"
            "       ('matplotlib', 'torchvision', 'sklearn', 'faiss', 'triton')]\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_every_module_has_one_path():
    """No aliases: a module is reached only where its file is."""
    import importlib
    import os
    root = os.path.dirname(os.path.abspath(nnkloss.__file__))
    for name in ("nnkloss.metrics", "nnkloss.search", "nnkloss.plots", "nnkloss.train",
                 "nnkloss.bank.distributed"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    for name in ("metrics", "search", "plots", "train", "nope"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(nnkloss, name)
    assert nnkloss.distributed.__file__ == os.path.join(root, "distributed.py")
    assert nnkloss.bank.exchange.__file__ == os.path.join(root, "bank", "exchange.py")
    assert nnkloss.knn is nnkloss.bank.search.knn
    assert nnkloss.experiment.Trainer is importlib.import_module("nnkloss.experiment.train").Trainer


def test_setup_py_ships_every_subpackage():
    """A regular (non-editable) install must carry every package of the tree."""
    import ast
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = ast.parse(open(os.path.join(root, "setup.py")).read())
    listed = next(ast.literal_eval(k.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) for k in node.keywords if k.arg == "packages")
    on_disk = {"nnkloss." + os.path.relpath(d, os.path.join(root, "nnkloss")).replace(os.sep, ".")
               for d, _, files in os.walk(os.path.join(root, "nnkloss")) if "__init__.py" in files}
    on_disk = {p.replace("nnkloss..", "nnkloss") for p in on_disk} | {"nnkloss.kernels"}
    assert set(listed) == on_disk


def test_the_repository_cites_nothing_outside_itself():
    """The maths and rules the code relies on live in docs/MATHS.md (the design in the
    repository's own docs/DESIGN.md); no tracked file points to design notes or papers outside
    the repository."""
    import re
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    # split so that this file does not cite what it looks for
    outside = re.compile("(?<!docs/)" + "DESIGN" + r"\.md|\.\./" + "shared|/work/" + "shared")
    cited = [f for f in files if os.path.isfile(os.path.join(root, f))
             and outside.search(open(os.path.join(root, f), errors="ignore").read())]
    assert cited == []


# Test files mirror the code (issue 19). tests/test_<name>.py names the module or package it
# tests: <name> is a module, source file or package of nnkloss/, kernels/, benchmarks/ or repro/,
# bare ("metrics", "cpu_kernel" for ops/cpu_kernel.cpp) or with its package path where the bare
# name is ambiguous ("ops_reference", "ops_neighbour_kernel"), optionally followed by an aspect
# ("kernels_tiles", "kernels_cuda"). Shared helpers live in tests/cases.py, tests/fabricate*.py
# and tests/reference.py (the one fp64 reference). The only other test files are the
# cross-cutting suites below, each with the reason it is not split by module.
CROSS_CUTTING = {
    "test_bad_input.py": "a table of every public entry point's bad-input errors (issue 10): one "
                         "place to see that each names the argument at fault",
    "test_numerics.py": "every backend of the op (torch, cpu, triton) and the loss module against "
                        "the fp64 reference at every scale, non-finite inputs (issue 10)",
    "test_compile.py": "the public API (loss module, functional op) under torch.compile and "
                       "torch.library.opcheck",
    "test_layout.py": "the architecture: imports, public names, packaging, this layout",
    "test_readme.py": "the README's examples run as written",
    "test_reference.py": "tests/reference.py, the tests' own fp64 reference (its name matches "
                         "nnkloss/ops/reference.py, whose tests are test_ops_reference.py)",
}


def _code_names(root):
    """Every name a test file may start with: each module, source file (Python, C++, shell)
    and package of the code, bare and with its package path ('reference', 'ops_reference',
    'nnkloss_ops_reference')."""
    names = set()
    for top in ("nnkloss", "kernels", "benchmarks", "repro"):
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if not x.startswith((".", "__")) and x != "results"]
            parts = os.path.relpath(d, root).split(os.sep)
            stems = [os.path.splitext(f)[0] for f in files
                     if f.endswith((".py", ".cpp", ".sh")) and f != "__init__.py"]
            for path in [parts] + [parts + [s] for s in stems]:
                names.update("_".join(path[i:]) for i in range(len(path)))
    return names


def test_every_test_file_names_a_module_or_is_a_documented_cross_cutting_suite():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = _code_names(root)
    assert {"metrics", "ops_reference", "cpu_kernel", "kernels", "bench_loss", "repro"} <= names
    files = sorted(f for f in os.listdir(os.path.join(root, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    stray = [f for f in files if f not in CROSS_CUTTING
             and not any(f[5:-3] == n or f[5:-3].startswith(n + "_") for n in names)]
    assert stray == [], ("name each test file after the module it tests (tests/test_layout.py "
                         "says how), or list it in CROSS_CUTTING with the reason", stray)
    assert sorted(set(CROSS_CUTTING) - set(files)) == []  # the list names only files that exist


@pytest.mark.parametrize("ci", [True, False])
def test_ci_runs_hypothesis_derandomized_without_a_database(ci):
    """With CI set, tests/conftest.py loads the "ci" hypothesis profile (the same examples every
    run, no example database); without it the randomised default stays. Run as under a
    Hypothesis without a built-in "ci" profile of its own, so that only conftest.py can pass."""
    code = ("from hypothesis import settings\n"
            "settings.register_profile('ci', settings.get_profile('default'))\n"
            "settings.load_profile('default')\n"
            "import conftest\n"
            "d = settings.default\n"
            "print(d.derandomize, d.database is None)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    res = subprocess.run([sys.executable, "-c", code], cwd=tests, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(ci), str(ci)]
