"""Tiny dataset trees in the official on-disk layouts, for the loader and script tests.

Each ``make_*`` writes a few small JPEGs (each image's colour encodes its class, so a network can
learn something from them) plus the index/annotation files the real dataset ships with, and
returns the root to pass to the loader.
"""
from __future__ import annotations

import os

import numpy as np


def _jpeg(path: str, cls: int, size=(40, 30), seed: int = 0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    base = np.array([(cls * 53) % 256, (cls * 97) % 256, (cls * 31) % 256], dtype=np.float64)
    arr = base[None, None, :] + rng.normal(0, 12, size=(h, w, 3))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_cub(root: str, n_classes: int = 4, per_class: int = 5, size=(40, 30)) -> str:
    """CUB_200_2011/ with images.txt, image_class_labels.txt, train_test_split.txt,
    bounding_boxes.txt, classes.txt and images/<class>/<name>.jpg. Returns the CUB_200_2011 path.
    Within each class, the first 3 images are official training images."""
    cub = os.path.join(root, "CUB_200_2011")
    lines = {"images": [], "labels": [], "split": [], "boxes": [], "classes": []}
    img_id = 0
    for c in range(1, n_classes + 1):
        cname = f"{c:03d}.Bird_{c}"
        lines["classes"].append(f"{c} {cname}")
        for j in range(per_class):
            img_id += 1
            rel = f"{cname}/Bird_{c}_{j:04d}.jpg"
            _jpeg(os.path.join(cub, "images", rel), c, size, seed=img_id)
            lines["images"].append(f"{img_id} {rel}")
            lines["labels"].append(f"{img_id} {c}")
            lines["split"].append(f"{img_id} {1 if j < 3 else 0}")
            lines["boxes"].append(f"{img_id} 2.0 3.0 20.0 15.0")
    for name, key in (("images.txt", "images"), ("image_class_labels.txt", "labels"),
                      ("train_test_split.txt", "split"), ("bounding_boxes.txt", "boxes"),
                      ("classes.txt", "classes")):
        with open(os.path.join(cub, name), "w") as f:
            f.write("\n".join(lines[key]) + "\n")
    return cub


def make_cars(root: str, n_classes: int = 4, per_class: int = 5, size=(40, 30)) -> str:
    """car_ims/NNNNNN.jpg + cars_annos.mat (struct array 'annotations' and 'class_names')."""
    import scipy.io

    os.makedirs(root, exist_ok=True)
    recs = []
    k = 0
    for c in range(1, n_classes + 1):
        for j in range(per_class):
            k += 1
            rel = f"car_ims/{k:06d}.jpg"
            _jpeg(os.path.join(root, rel), c, size, seed=100 + k)
            recs.append((rel, 3, 4, 30, 25, c, 0 if j < 3 else 1))
    dt = [("relative_im_path", "O"), ("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"),
          ("bbox_y2", "O"), ("class", "O"), ("test", "O")]
    ann = np.zeros((1, len(recs)), dtype=dt)
    for i, r in enumerate(recs):
        ann[0, i] = (np.array([r[0]]), np.array([[r[1]]], np.uint8), np.array([[r[2]]], np.uint8),
                     np.array([[r[3]]], np.uint16), np.array([[r[4]]], np.uint16),
                     np.array([[r[5]]], np.uint8), np.array([[r[6]]], np.uint8))
    names = np.array([f"Car model {c}" for c in range(1, n_classes + 1)], dtype=object)
    scipy.io.savemat(os.path.join(root, "cars_annos.mat"),
                     {"annotations": ann, "class_names": names.reshape(1, -1)})
    return root


def make_flowers(root: str, n_classes: int = 3, per_class: int = 6, size=(40, 30)) -> str:
    """jpg/image_NNNNN.jpg + imagelabels.mat + setid.mat (2 train, 2 val, rest test per class)."""
    import scipy.io

    os.makedirs(root, exist_ok=True)
    labels, trn, val, tst = [], [], [], []
    k = 0
    for c in range(1, n_classes + 1):
        for j in range(per_class):
            k += 1
            _jpeg(os.path.join(root, "jpg", f"image_{k:05d}.jpg"), c, size, seed=200 + k)
            labels.append(c)
            (trn if j < 2 else val if j < 4 else tst).append(k)
    scipy.io.savemat(os.path.join(root, "imagelabels.mat"),
                     {"labels": np.array(labels, np.uint8).reshape(1, -1)})
    scipy.io.savemat(os.path.join(root, "setid.mat"),
                     {"trnid": np.array(trn, np.uint16).reshape(1, -1),
                      "valid": np.array(val, np.uint16).reshape(1, -1),
                      "tstid": np.array(tst, np.uint16).reshape(1, -1)})
    return root


def make_leafsnap(root: str, n_classes: int = 3, per_class: int = 10, lab_per_class: int = 2,
                  size=(40, 30)) -> str:
    """leafsnap-dataset-images.txt (tab separated, header) + dataset/images/{field,lab}/..."""
    os.makedirs(root, exist_ok=True)
    rows = ["file_id\timage_path\tsegmented_path\tspecies\tsource"]
    k = 0
    for c in range(1, n_classes + 1):
        species = f"Acer species{c}"
        folder = species.lower().replace(" ", "_")
        for source, n in (("field", per_class), ("lab", lab_per_class)):
            for j in range(n):
                k += 1
                rel = f"dataset/images/{source}/{folder}/{k}.jpg"
                _jpeg(os.path.join(root, rel), c, size, seed=300 + k)
                rows.append(f"{k}\t{rel}\tdataset/segmented/{source}/{folder}/{k}.png\t"
                            f"{species}\t{source}")
    with open(os.path.join(root, "leafsnap-dataset-images.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")
    return root
