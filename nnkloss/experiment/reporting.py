"""Writing results of the reproduction scripts: results.json and text/markdown tables, and the
commit that every result of repro/ and benchmarks/ is labelled with.

Numbers in results.json are fractions in [0, 1] (as the metric functions return them); tables
show percentages with two decimals, the papers' format.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Optional, Sequence

from ..atomic import atomic_write

__all__ = ["write_json", "write_table", "markdown_table", "percent", "git_commit"]

# Where the repository's runs write their results (CSV rows, logs, run folders): a change there
# is not a change of the code measured, so it does not make a commit "-dirty".
RESULTS_DIRS = ("benchmarks/results", "repro/results")


def git_commit(cwd: str) -> Optional[str]:
    """The short hash of HEAD of the checkout holding ``cwd``, with ``-dirty`` when a tracked
    file outside RESULTS_DIRS differs from it (so a second run, which finds the rows the first
    appended, is labelled with the code it measured); ``$NNKLOSS_COMMIT`` where set (the device
    machine's copy of the tree has no .git: benchmarks/gpu_session.sh passes it in); None
    outside a checkout or without git."""
    if os.environ.get("NNKLOSS_COMMIT"):
        return os.environ["NNKLOSS_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    exclude = [f":(top,exclude){d}" for d in RESULTS_DIRS]
    try:
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ":(top)", *exclude],
                               cwd=cwd, capture_output=True).returncode == 1
    except OSError:
        dirty = False
    return (head + ("-dirty" if dirty else "")) if head else None


def write_json(path: str, obj) -> str:
    """Write ``obj`` as indented JSON, atomically. Returns ``path``."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))
    return path


def percent(v: Optional[float]) -> str:
    """0.7105 -> "71.05"; None -> "-"."""
    return "-" if v is None else f"{100.0 * float(v):.2f}"


def write_table(path: str, table: str) -> str:
    """Write a results table (markdown) atomically and print it. Returns ``path``."""
    atomic_write(path, table.encode("utf-8"))
    print(table)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence], title: str = "") -> str:
    """A GitHub-markdown table (readable as plain text too), columns padded to equal width."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    out = [f"**{title}**", ""] if title else []
    out.append(line(cells[0]))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [line(r) for r in cells[1:]]
    return "\n".join(out) + "\n"
