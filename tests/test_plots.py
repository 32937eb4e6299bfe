"""Plots: one call each, non-empty PNG files, clear errors."""
import numpy as np
import pytest
import torch

import nnkloss
from nnkloss.experiment import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def blobs(n=120, d=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(n // classes)
    return torch.randn(classes, d, generator=g)[labels] * 5 + torch.randn(n, d, generator=g), labels


@pytest.mark.parametrize("method", ["tsne", "pca"])
def test_plot_embedding_writes_png(tmp_path, method):
    emb, labels = blobs()
    out = plots.plot_embedding(emb, labels, tmp_path / f"{method}.png", method=method)
    assert out == str(tmp_path / f"{method}.png")
    assert_png(tmp_path / f"{method}.png")


def test_plot_embedding_many_classes_subset_numpy(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(300, 8)).astype(np.float32)
    labels = rng.integers(0, 40, size=300)
    plots.plot_embedding(emb, labels, tmp_path / "e.png", method="pca", max_points=100,
                         title="subset")
    assert_png(tmp_path / "e.png")
    # bf16 tensors and 2-D embeddings (plotted as they are) work too.
    plots.plot_embedding(torch.randn(50, 2).bfloat16(), torch.arange(50) % 3, tmp_path / "f.png")
    assert_png(tmp_path / "f.png")


def test_plot_recall_curve_writes_png(tmp_path):
    results = {"nngk": {1: 0.6, 2: 0.72, 4: 0.81, 8: 0.88},
               "ccknn": {1: 0.55, 2: 0.7, 4: 0.8, 8: 0.86, 16: 0.9}}
    plots.plot_recall_curve(results, tmp_path / "r.png")
    assert_png(tmp_path / "r.png")
    emb, labels = blobs()
    plots.plot_recall_curve({"one": nnkloss.evaluation.metrics.recall_at_k(emb, labels)},
                            tmp_path / "s.png")
    assert_png(tmp_path / "s.png")


def test_a_plot_is_written_atomically(tmp_path, monkeypatch):
    """A figure whose writing fails half-way (a full disk, a kill) leaves the previous file
    as it was and no partial one; the format follows the extension."""
    from matplotlib.figure import Figure
    results = {"nngk": {1: 0.6, 2: 0.72, 4: 0.81}}
    path = tmp_path / "r.png"
    plots.plot_recall_curve(results, path)
    before = path.read_bytes()
    real = Figure.savefig

    def torn(self, f, **kw):
        real(self, f, **kw)
        f.truncate(100)
        raise OSError("disk full")
    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(OSError, match="disk full"):
        plots.plot_recall_curve({"other": {1: 0.1, 2: 0.2}}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.png"]
    monkeypatch.undo()
    plots.plot_recall_curve(results, tmp_path / "r.pdf")
    assert (tmp_path / "r.pdf").read_bytes()[:5] == b"%PDF-"


def test_plot_errors(tmp_path):
    emb, labels = blobs()
    with pytest.raises(ValueError, match="method"):
        plots.plot_embedding(emb, labels, tmp_path / "x.png", method="umap")
    with pytest.raises(ValueError, match="labels"):
        plots.plot_embedding(emb, labels[:5], tmp_path / "x.png")
    with pytest.raises(TypeError, match="labels"):
        plots.plot_embedding(emb, labels.float(), tmp_path / "x.png")
    with pytest.raises(FileNotFoundError, match="directory"):
        plots.plot_embedding(emb, labels, tmp_path / "missing" / "x.png", method="pca")
    with pytest.raises(ValueError, match="results"):
        plots.plot_recall_curve({}, tmp_path / "r.png")
    with pytest.raises(ValueError, match="keys"):
        plots.plot_recall_curve({"a": {0: 0.5}}, tmp_path / "r.png")
    assert not any(tmp_path.iterdir())
