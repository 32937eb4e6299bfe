"""Results of the reproduction scripts: results.json (fractions in [0, 1]), markdown tables
(percentages, two decimals) and the commit every result is labelled with."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Optional, Sequence

from ..atomic import atomic_write

__all__ = ["write_json", "write_table", "markdown_table", "percent", "git_commit"]

# Where runs write their results: changes there do not make a commit "-dirty".
RESULTS_DIRS = ("benchmarks/results", "repro/results")


def git_commit(cwd: str) -> Optional[str]:
    """``$NNKLOSS_COMMIT`` where set, else the short hash of HEAD of the checkout holding
    ``cwd`` (``-dirty`` when a tracked file outside RESULTS_DIRS differs); None without git."""
    if os.environ.get("NNKLOSS_COMMIT"):
        return os.environ["NNKLOSS_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    exclude = [f":(top,exclude){d}" for d in RESULTS_DIRS]
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ":(top)", *exclude],
                           cwd=cwd, capture_output=True).returncode == 1
    return (head + ("-dirty" if dirty else "")) if head else None


def write_json(path: str, obj) -> str:
    """Write ``obj`` as indented JSON, atomically. Returns ``path``."""
    return atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))


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
    out += [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out) + "\n"
