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
    for name in ("search", "plots", "train", "nope"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(nnkloss, name)
    assert nnkloss.distributed.__file__ == os.path.join(root, "distributed.py")
    assert nnkloss.bank.exchange.__file__ == os.path.join(root, "bank", "exchange.py")
    assert nnkloss.knn is nnkloss.bank.search.knn
    assert nnkloss.experiment.Trainer is importlib.import_module("nnkloss.experiment.train").Trainer


def test_the_evaluation_metrics_are_nnkloss_metrics():
    """Users reach for nnkloss.metrics (an AttributeError before): it is the one metrics
    module, nnkloss.evaluation.metrics, as an attribute of the package, not a second path."""
    assert "metrics" in nnkloss.__all__
    from nnkloss import metrics
    assert metrics is nnkloss.evaluation.metrics and metrics.evaluate is nnkloss.metrics.evaluate


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
# bare ("metrics", "cpu_op" for cpu/op.py) or with its package path where the bare
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
    assert {"metrics", "ops_reference", "cpu_op", "kernels", "bench_loss", "repro"} <= names
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


# Import edges allowed to close a circle (none: the op's checks no longer import the op).
KNOWN_CIRCLE_EDGES = set()


def _import_graph(root):
    """{module: {(imported module, line)}} of every package module (nnkloss/**/*.py, and
    kernels/*.py as nnkloss.kernels.*), from the AST: module-level and function-level imports
    and importlib.import_module("literal"). ``from P import n`` is an edge to P.n when that
    is a module, else to P; imports from outside the package are left out."""
    import ast
    files = {}
    for top, package in (("nnkloss", "nnkloss"), ("kernels", "nnkloss.kernels")):
        for d, dirs, names in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if not x.startswith((".", "__"))]
            rel = os.path.relpath(d, os.path.join(root, top))
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for f in names:
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    files[name] = (os.path.join(d, f), f == "__init__.py")
    graph = {}
    for name, (path, is_package) in files.items():
        edges = graph[name] = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = name.split(".")[:len(name.split(".")) - node.level + is_package]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [node.args[0].value]
            for t in targets:
                while t and t not in files:  # import a.b.c: the deepest package module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add((t, node.lineno))
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_is_acyclic_and_validation_imports_no_op():
    """No import circle in the package, counting imports made inside functions (which only
    hide a circle), and the pure checks (nnkloss.validation) import nothing from nnkloss.ops."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = _import_graph(root)
    assert {t for t, _ in graph["nnkloss.bank.centre_bank"]} >= {"nnkloss.bank.centroids",
                                                                "nnkloss.validation"}
    stale = {e for e in KNOWN_CIRCLE_EDGES if e[1] not in {t for t, _ in graph.get(e[0], ())}}
    assert not stale, ("these allowed edges are gone: delete them from KNOWN_CIRCLE_EDGES", stale)
    plain = {m: {t for t, _ in edges if (m, t) not in KNOWN_CIRCLE_EDGES}
             for m, edges in graph.items()}
    cycles = _cycles(plain)
    where = [sorted(f"{m}:{line} -> {t}" for m in c for t, line in graph[m] if t in c)
             for c in cycles]
    assert cycles == [], where
    into_ops = sorted(t for t in plain["nnkloss.validation"]
                      if t == "nnkloss.ops" or t.startswith("nnkloss.ops."))
    assert into_ops == []


def test_the_import_graph_sees_hidden_imports(tmp_path):
    """The graph counts an import inside a function, a relative one from a package and
    importlib.import_module, so a circle cannot hide in any of them."""
    pkg = tmp_path / "nnkloss"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("import importlib\nimportlib.import_module('nnkloss.a')\n")
    (tmp_path / "kernels" / "__init__.py").write_text("from nnkloss.sub import b\n")
    graph = {m: {t for t, _ in e} for m, e in _import_graph(str(tmp_path)).items()}
    assert graph == {"nnkloss": set(), "nnkloss.a": {"nnkloss.sub.b"},
                     "nnkloss.sub": {"nnkloss.sub.b"}, "nnkloss.sub.b": {"nnkloss.a"},
                     "nnkloss.kernels": {"nnkloss.sub.b"}}
    assert _cycles(graph) == [["nnkloss.a", "nnkloss.sub.b"]]
