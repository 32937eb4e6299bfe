"""Tiny MNIST-format (IDX) data sets in the official on-disk layouts, for tests."""
import gzip
import os
import struct

import numpy as np


def idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    """The IDX encoding of ``arr``: magic 0x0000, type ``code``, ndim, big-endian sizes, data."""
    big = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    arr = np.asarray(arr).astype(big[code])  # IDX data are big-endian
    head = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return head + arr.tobytes()


def write_bytes(path: str, data: bytes, gz: bool = True) -> str:
    """Write ``data`` to ``path`` (gzipped to ``path + ".gz"`` with ``gz``); returns the path."""
    if gz:
        path += ".gz"
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def write_idx(path: str, arr: np.ndarray, gz: bool = True, code: int = 0x08) -> str:
    return write_bytes(path, idx_bytes(arr, code), gz)


def make_images(labels: np.ndarray, size: int = 28, seed: int = 0) -> np.ndarray:
    """uint8 images (N, size, size) whose class is easy to learn: class c lights a bar at a
    class-specific row, plus noise."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    img = rng.integers(0, 60, size=(n, size, size)).astype(np.uint8)
    for i, c in enumerate(labels):
        r = 1 + (int(c) * (size - 3)) // 10
        img[i, r:r + 2, 2:size - 2] = 255
    return img


def make_idx_tree(root: str, n_train: int = 60, n_test: int = 30, gz: bool = True,
                  layout: str = "flat", size: int = 28, seed: int = 0,
                  folder: str = "FashionMNIST") -> str:
    """Write the four files; returns the folder to pass as ``root``.

    layout: "flat" (the four files in ``root``, as Debian's package) or "torchvision"
    (``root/<folder>/raw/``; ``root`` is returned).
    """
    d = root if layout == "flat" else os.path.join(root, folder, "raw")
    os.makedirs(d, exist_ok=True)
    for split, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        np.random.default_rng(s).shuffle(labels)
        write_idx(os.path.join(d, f"{split}-images-idx3-ubyte"), make_images(labels, size, s), gz)
        write_idx(os.path.join(d, f"{split}-labels-idx1-ubyte"), labels, gz)
    return root
