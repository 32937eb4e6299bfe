"""Writing results of the reproduction scripts: results.json and text/markdown tables.

Numbers in results.json are fractions in [0, 1] (as the metric functions return them); tables
show percentages with two decimals, the papers' format.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from ..atomic import atomic_write

__all__ = ["write_json", "write_table", "markdown_table", "percent"]


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
