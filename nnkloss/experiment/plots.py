"""One-call plots: embedding maps, Recall@K and training curves, written atomically
(matplotlib, Agg, and scikit-learn are imported only when a plot is made)."""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from ..atomic import atomic_write
from ..validation import require_parent_dir
from .seeds import check_seed

__all__ = ["plot_embedding", "plot_recall_curve", "plot_training_curves", "METHODS"]

METHODS = ("tsne", "pca")


def _pyplot():
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # headless; a session that already uses pyplot keeps its backend
    import matplotlib.pyplot as plt
    return plt


def _to_numpy(name: str, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _save(plt, fig, path: str, dpi: int = 120) -> str:
    """Write ``fig`` to ``path`` atomically, in the format of its extension."""
    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:].lower() or None
    try:
        return atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format=fmt))
    finally:
        plt.close(fig)


def _project(x: np.ndarray, method: str, seed: int) -> np.ndarray:
    """(N, 2) coordinates of the (N, D) points."""
    if x.shape[1] <= 2:
        return np.pad(x, ((0, 0), (0, 2 - x.shape[1])))
    if method == "pca":
        from sklearn.decomposition import PCA
        return PCA(n_components=2, random_state=seed).fit_transform(x)
    from sklearn.manifold import TSNE
    perp = min(30.0, max(1.0, (x.shape[0] - 1) / 3.0))  # below N / 3 for small sets
    return TSNE(n_components=2, perplexity=perp, init="pca", random_state=seed).fit_transform(x)


def plot_embedding(emb, labels, path, method: str = "tsne", max_points: Optional[int] = 5000,
                   seed: int = 0, title: Optional[str] = None) -> str:
    """Save a scatter plot of embeddings projected to 2-D, coloured by class; returns ``path``.

    Args:
        emb: (N, D) float embeddings (tensor or numpy array); labels: (N,) integer labels.
        path: output image path (its directory must exist; the format by its extension).
        method: "tsne" or "pca".
        max_points: plot a random subset of this many points (None: all).
        seed: subset and projection seed.
        title: figure title (default: the method).
    """
    x = _to_numpy("emb", emb)
    y = _to_numpy("labels", labels)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"emb must be (N, D) with N >= 2, got shape {x.shape}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"labels must be (N,) = ({x.shape[0]},), got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"labels must have an integer dtype, got {y.dtype}")
    if not np.isfinite(x).all():
        raise ValueError("emb contains NaN or inf")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if max_points is not None and (isinstance(max_points, bool) or int(max_points) < 2):
        raise ValueError(f"max_points must be an int >= 2 or None, got {max_points!r}")
    seed = check_seed(seed)
    path = require_parent_dir("path", path)
    if max_points is not None and x.shape[0] > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(x.shape[0], int(max_points),
                                                          replace=False))
        x, y = x[keep], y[keep]
    xy = _project(x.astype(np.float64), method, seed)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 7))
    classes = np.unique(y)
    few = len(classes) <= 20  # beyond that a legend hides the picture
    cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20" if few else "gist_ncar")
    colours = np.searchsorted(classes, y)  # a listed map's index, else a place in [0, 1]
    ax.scatter(xy[:, 0], xy[:, 1], c=cmap(colours if few else colours / (len(classes) - 1)),
               s=6.0, linewidths=0)
    if few:
        from matplotlib.lines import Line2D
        handles = [Line2D([], [], marker="o", linestyle="", markersize=5, color=cmap(i),
                          label=str(c)) for i, c in enumerate(classes)]
        ax.legend(handles=handles, title="class", loc="best", fontsize=8, markerscale=1.2,
                  ncol=1 if len(classes) <= 10 else 2)
    ax.set(xticks=[], yticks=[], title=title if title is not None else
           f"{method.upper()} of {x.shape[0]} embeddings, {len(classes)} classes")
    return _save(plt, fig, path)


def plot_recall_curve(results: Mapping[str, Mapping[int, float]], path,
                      title: str = "Recall@K") -> str:
    """Save Recall@K curves of one or more named methods; returns ``path``.

    Args:
        results: {method name: {K: recall in [0, 1]}}.
        path: output image path (its directory must exist).
        title: figure title (K on a log2 axis).
    """
    if not isinstance(results, Mapping) or not results:
        raise ValueError("results must be a non-empty {name: {k: recall}} mapping")
    curves: Dict[str, tuple] = {}
    for name, rec in results.items():
        if not isinstance(rec, Mapping) or not rec:
            raise ValueError(f"results[{name!r}] must be a non-empty {{k: recall}} mapping")
        ks = sorted(rec)
        if any(isinstance(k, bool) or int(k) != k or k < 1 for k in ks):
            raise ValueError(f"results[{name!r}] keys must be positive ints, got {ks}")
        curves[str(name)] = (ks, [float(rec[k]) for k in ks])
    path = require_parent_dir("path", path)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, (ks, vals) in curves.items():
        ax.plot(ks, [100.0 * v for v in vals], marker="o", label=name)
    ax.set_xscale("log", base=2)
    all_ks = sorted({k for ks, _ in curves.values() for k in ks})
    ax.set_xticks(all_ks, [str(k) for k in all_ks])
    ax.set(xlabel="K", ylabel="Recall@K (%)", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_training_curves(histories: Mapping[str, List[Mapping]], path: str,
                         keys: Sequence[str] = ("loss",), title: str = "Training") -> str:
    """One panel per key (e.g. "loss", "recall@1"), one line per run, against the epoch.

    Args:
        histories: {run name: Trainer.history (list of per-epoch dicts with "epoch")}.
        path: output image path (its directory must exist); returned.
        keys: which logged values to plot; runs lacking a key are skipped in that panel.
        title: figure title.
    """
    if not histories:
        raise ValueError("histories is empty")
    path = require_parent_dir("path", path)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, hist in histories.items():
            pts = [(r["epoch"], r[key]) for r in hist if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=name)
        ax.set(xlabel="epoch", title=key)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path, dpi=110)
