"""Writing results of the reproduction scripts: results.json, text/markdown tables, curves.

Numbers in results.json are fractions in [0, 1] (as the metric functions return them); tables
show percentages with two decimals, the papers' format.
"""
from __future__ import annotations

import json
import os
from typing import List, Mapping, Optional, Sequence

from .train import atomic_write

__all__ = ["write_json", "markdown_table", "percent", "plot_training_curves"]


def write_json(path: str, obj) -> str:
    """Write ``obj`` as indented JSON, atomically. Returns ``path``."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))
    return path


def percent(v: Optional[float]) -> str:
    """0.7105 -> "71.05"; None -> "-"."""
    return "-" if v is None else f"{100.0 * float(v):.2f}"


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


def plot_training_curves(histories: Mapping[str, List[Mapping]], path: str,
                         keys: Sequence[str] = ("loss",), title: str = "Training") -> str:
    """One panel per key (e.g. "loss", "recall@1"), one line per run, against the epoch.

    Args:
        histories: {run name: Trainer.history (list of per-epoch dicts with "epoch")}.
        path: PNG path (its directory must exist).
        keys: which logged values to plot; runs lacking a key are skipped in that panel.
    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if not histories:
        raise ValueError("histories is empty")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"output directory does not exist: {directory}")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, hist in histories.items():
            pts = [(r["epoch"], r[key]) for r in hist if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=name)
        ax.set_xlabel("epoch")
        ax.set_title(key)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
