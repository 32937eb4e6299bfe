"""Data sets of the experiments in their official on-disk layouts; nothing is downloaded.

Items are ``(input, label, idx)``: the input (an image's ``transform``), a label in
``0 .. num_classes - 1`` and the item's position, its row in a :class:`nnkloss.CentreBank`
over the data set. Files are checked when the data set is built: a missing or malformed one,
or an image path leaving the data set's folder, raises :class:`FileNotFoundError` /
:class:`DatasetFormatError` naming the file (and line).

Protocols of the image data sets: ``"metric"`` (Song et al. 2016) trains on the first half of
the classes by official id and tests on the second; ``"classification"`` splits all classes
(``"val"`` held out where no official one exists). Labels: ``0 .. C-1`` by official id.
"""
from __future__ import annotations

import math
import os
from collections import namedtuple
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .seeds import check_seed

__all__ = ["DatasetFormatError", "ImageListDataset", "CUB200", "Cars196", "Flowers102",
           "Leafsnap", "stratified_split", "as_tensor_labels", "IndexedTensorDataset",
           "read_idx", "find_idx_file", "IDXDataset", "FashionMNIST", "MNIST",
           "KMNIST", "IDX_SETS", "IDX_FILES"]

#: The splits of each protocol of the image data sets.
SPLITS = {"metric": ("train", "test"), "classification": ("train", "val", "trainval", "test")}


class DatasetFormatError(ValueError):
    """An index/annotation file exists but does not have the expected content."""


def _require(path: str, what: str, exists: Callable[[str], bool] = os.path.isfile) -> str:
    if not exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _check_split(protocol: str, split: str) -> None:
    if protocol not in SPLITS:
        raise ValueError(f"protocol must be one of {tuple(SPLITS)}, got {protocol!r}")
    if split not in SPLITS[protocol]:
        raise ValueError(f"split must be one of {SPLITS[protocol]} for protocol={protocol!r}, "
                         f"got {split!r}")


def stratified_split(labels: Sequence[int], fractions: Sequence[float], seed: int
                     ) -> List[np.ndarray]:
    """Split item positions into parts with the given fractions, class by class.

    Args:
        labels: (N,) class of each item (any hashable ints).
        fractions: part sizes, summing to 1 (e.g. (0.8, 0.2)).
        seed: the split depends only on ``seed`` and ``labels``.
    Returns:
        one sorted int64 array of positions per part; per class the boundaries are
        ``round(cumulative fraction * n_class)``, and the first part gets at least one item
        of every class.
    """
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.ndim != 1 or (fr < 0).any() or abs(fr.sum() - 1.0) > 1e-6:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {list(fractions)}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(check_seed(seed))
    parts: List[List[np.ndarray]] = [[] for _ in fr]
    cum = np.cumsum(fr)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        members = members[rng.permutation(len(members))]
        n = len(members)
        bounds = np.round(cum * n).astype(int)
        bounds[-1] = n
        bounds[0] = max(bounds[0], min(1, n))  # never leave a class out of the first part
        for p, chunk in enumerate(np.split(members, np.maximum.accumulate(bounds)[:-1])):
            parts[p].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64)
            for p in parts]


def _finite_float(text: str) -> float:
    """float() of a table field, refusing nan and inf (which float() reads)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _inside_root(entry: str, where: str) -> None:
    """DatasetFormatError naming ``where`` unless ``entry``, an image path from an index file,
    stays inside the dataset folder (neither absolute nor with a ``..`` component)."""
    if not entry:
        raise DatasetFormatError(f"{where}: empty image path")
    absolute = (os.path.isabs(entry) or entry[0] in "/\\"
                or (entry[0].isalpha() and entry[1:2] == ":"))
    why = ("holds a NUL byte" if "\0" in entry else "is absolute" if absolute
           else "has a '..' component" if ".." in entry.replace("\\", "/").split("/") else None)
    if why:
        raise DatasetFormatError(f"{where}: image path {entry!r} {why}; entries must stay "
                                 "inside the dataset folder")


def _read_table(path: str, what: str, types: Sequence[Callable], path_cols: Sequence[int] = (),
                sep: Optional[str] = None, header: Sequence[str] = ()) -> List[tuple]:
    """Lines of one field per type in ``types`` (split at ``sep``, default whitespace), converted,
    after a first line of the column names ``header`` if given; the fields at ``path_cols`` are
    image paths (:func:`_inside_root`)."""
    _require(path, what)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise DatasetFormatError(f"{path}: not utf-8 text ({e})") from None
    ncols = len(types)
    rows = []
    for lineno, line in enumerate(lines, 1):
        fields = [x.strip() for x in line.rstrip("\r\n").split(sep)]
        if header and lineno == 1:
            if fields != list(header):
                raise DatasetFormatError(f"{path}, line 1: expected the header "
                                         f"{list(header)}, got {fields}")
            continue
        if not any(fields):
            continue
        if len(fields) != ncols:
            raise DatasetFormatError(f"{path}, line {lineno}: expected {ncols} fields, got "
                                     f"{len(fields)}: {line.strip()[:80]!r}")
        for col in path_cols:
            _inside_root(fields[col], f"{path}, line {lineno}"
                         + (f" ({header[col]})" if header else ""))
        try:
            rows.append(tuple(t(v) for t, v in zip(types, fields)))
        except ValueError as e:
            raise DatasetFormatError(f"{path}, line {lineno}: {e}") from None
    if not rows:
        raise DatasetFormatError(f"{path} is empty")
    return rows


#: The most bytes the compressed elements of a MATLAB file may inflate to.
MAT_MAX_BYTES = 1 << 28


def _check_mat_inflation(path: str, max_bytes: int) -> None:
    """Refuse a MATLAB v5 file whose compressed elements inflate to more than ``max_bytes``
    (scipy would inflate each whole), counted in bounded steps; other files are left to scipy."""
    import struct
    import zlib
    with open(path, "rb") as f:
        order = {b"IM": "<", b"MI": ">"}.get(f.read(128)[126:128])
        if order is None:  # not a MATLAB v5 file
            return
        total = 0
        while True:
            tag = f.read(8)
            if len(tag) < 8:
                return
            mtype, nbytes = struct.unpack(order + "II", tag)
            if mtype >> 16:      # a small element: its data are in the tag
                continue
            if mtype != 15:      # miCOMPRESSED; anything else is read as stored
                f.seek(nbytes, os.SEEK_CUR)
                continue
            inflate, left = zlib.decompressobj(), nbytes
            while left > 0 and (data := f.read(min(left, 1 << 20))):
                left -= len(data)
                while data and total <= max_bytes:
                    try:
                        total += len(inflate.decompress(data, 1 << 22))
                    except zlib.error:
                        return   # scipy reports the damage
                    data = inflate.unconsumed_tail
                if total > max_bytes:
                    raise DatasetFormatError(
                        f"{path}: its compressed elements inflate to more than {max_bytes} "
                        "bytes (max_bytes); not an annotation file of this data set")


def _loadmat(path: str, what: str, keys: Sequence[str]) -> dict:
    _require(path, what)
    _check_mat_inflation(path, MAT_MAX_BYTES)
    try:
        import scipy.io
    except ImportError as e:  # pragma: no cover - scipy is in the "vision" extra
        raise ImportError(f"reading {path} needs scipy (pip install scipy)") from e
    try:
        mat = scipy.io.loadmat(path, squeeze_me=True, struct_as_record=True)
    except Exception as e:  # scipy raises several types for corrupt files
        raise DatasetFormatError(f"{path} is not a readable MATLAB file: {e}") from None
    missing = [k for k in keys if k not in mat]
    if missing:
        raise DatasetFormatError(f"{path} has no variable(s) {missing}; found "
                                 f"{sorted(k for k in mat if not k.startswith('__'))}")
    return mat


def _int_vector(mat: dict, key: str, path: str) -> np.ndarray:
    v = np.atleast_1d(np.asarray(mat[key]))
    if v.dtype == object or v.ndim != 1 or not np.issubdtype(v.dtype, np.number):
        raise DatasetFormatError(f"{path}: variable {key!r} must be a numeric vector, "
                                 f"got shape {v.shape} dtype {v.dtype}")
    return v.astype(np.int64)


class ImageListDataset(Dataset):
    """A list of image files with labels (and optional crop boxes), read with PIL on access.

    Args:
        paths: image file paths.
        labels: (N,) int labels in 0..num_classes-1.
        num_classes: C (a split may not contain every class).
        transform: applied to the RGB ``PIL.Image`` (after the box crop).
        boxes: optional (N, 4) float boxes ``(left, upper, right, lower)`` in pixels (PIL's
            crop convention); the image is cropped to its box, clipped to the image, before
            ``transform``.
    Attributes:
        paths, labels (int64 numpy), num_classes.
    """

    def __init__(self, paths: Sequence[str], labels: Sequence[int], num_classes: int,
                 transform: Optional[Callable] = None, boxes: Optional[np.ndarray] = None):
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        if len(self.paths) != len(self.labels):
            raise ValueError(f"{len(self.paths)} paths but {len(self.labels)} labels")
        if boxes is not None:
            boxes = np.asarray(boxes, dtype=np.float64)
            if boxes.shape != (len(self.paths), 4):
                raise ValueError(f"boxes must have shape ({len(self.paths)}, 4), got {boxes.shape}")
            finite = np.isfinite(boxes).all(axis=1)
            if not finite.all():
                bad = int(np.flatnonzero(~finite)[0])
                raise ValueError(f"boxes must be finite; item {bad} ({self.paths[bad]}) has "
                                 f"{boxes[bad].tolist()}")
        self.boxes = boxes
        self.num_classes = int(num_classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def load_image(self, i: int):
        """The RGB PIL image of item ``i``, box-cropped if boxes were given; more pixels than
        ``Image.MAX_IMAGE_PIXELS`` is refused from the header, before decoding."""
        from PIL import Image

        path = self.paths[i]
        try:
            with Image.open(path) as im:
                limit = Image.MAX_IMAGE_PIXELS
                if limit is not None and im.width * im.height > limit:
                    raise DatasetFormatError(
                        f"image {path} is {im.width} x {im.height} pixels, more than PIL's "
                        f"Image.MAX_IMAGE_PIXELS = {limit} (raise it to read such images)")
                img = im.convert("RGB")
        except FileNotFoundError:
            raise FileNotFoundError(f"image not found: {path}") from None
        except (OSError, Image.DecompressionBombError) as e:
            raise DatasetFormatError(f"cannot read image {path}: {e}") from None
        if self.boxes is not None:
            box = np.clip(np.round(self.boxes[i]), 0, img.size * 2).astype(int)  # (w, h, w, h)
            if box[2] > box[0] and box[3] > box[1]:  # a degenerate box keeps the whole image
                img = img.crop(tuple(box.tolist()))
        return img

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        img = self.load_image(i)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.labels[i]), i


class _OfficialImages(ImageListDataset):
    """An image data set read from its official index: the shared protocol and split logic."""

    def _build(self, root: str, protocol: str, split: str, cls: np.ndarray, paths: List[str],
               parts: Callable[[], Dict[str, np.ndarray]], transform, check_files: bool,
               boxes=None) -> None:
        """Keep ``split`` of the items of official classes ``cls`` and images ``paths``; ``parts()``
        gives the classification positions of "train", "val" and "test", ``boxes`` the (N, 4)
        crop boxes or a function of the kept positions giving theirs."""
        order = sorted(set(cls.tolist()))
        if protocol == "metric":
            half = len(order) // 2
            universe = order[:half] if split == "train" else order[half:]
            pos = np.flatnonzero(np.isin(cls, universe))
        else:
            universe, p = order, parts()
            pos = np.sort(np.concatenate([p["train"], p["val"]]) if split == "trainval"
                          else p[split])
        if boxes is not None:
            boxes = boxes(pos) if callable(boxes) else boxes[pos]
        lut = {c: i for i, c in enumerate(universe)}
        super().__init__([paths[i] for i in pos], [lut[c] for c in cls[pos]], len(universe),
                         transform, boxes)
        self.root, self.protocol, self.split = root, protocol, split
        missing = [p for p in self.paths if not os.path.isfile(p)] if check_files else []
        if missing:
            raise FileNotFoundError(f"image not found: {missing[0]} ({len(missing)} of "
                                    f"{len(self.paths)} images missing)")


def _held_out(cls: np.ndarray, is_train: np.ndarray, val_fraction: float, seed: int
              ) -> Dict[str, np.ndarray]:
    """The official test set, and the official training set less a stratified ``val``."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    official = np.flatnonzero(is_train)
    tr, va = stratified_split(cls[official], (1.0 - val_fraction, val_fraction), seed)
    return {"train": official[tr], "val": official[va], "test": np.flatnonzero(~is_train)}


class CUB200(_OfficialImages):
    """Caltech-UCSD Birds-200-2011 (11,788 images, 200 species).

    Args:
        root: the ``CUB_200_2011`` folder (holding images.txt, image_class_labels.txt,
            train_test_split.txt, bounding_boxes.txt and images/), or its parent.
        split: see the module docstring.
        protocol: "metric" (classes 1-100 train / 101-200 test) or "classification" (the
            official train/test split, with ``val_fraction`` of train held out as "val").
        transform: torchvision-style transform of the PIL image.
        bbox_crop: crop each image to its bounding box (the papers do for classification only).
        val_fraction: held-out part of the official training set (the papers: 0.2).
        seed: seed of the validation split.
        check_files: stat every image at construction (fails early on a partial copy).
    """

    def __init__(self, root: str, split: str = "train", protocol: str = "metric",
                 transform: Optional[Callable] = None, bbox_crop: bool = False,
                 val_fraction: float = 0.2, seed: int = 0, check_files: bool = True):
        _check_split(protocol, split)
        if os.path.isdir(os.path.join(root, "CUB_200_2011")):
            root = os.path.join(root, "CUB_200_2011")
        _require(root, "CUB_200_2011 folder", os.path.isdir)

        def table(name, types, path_cols=()):
            return _read_table(os.path.join(root, name), f"CUB {name}", types, path_cols)

        def by_id(name, types):
            """The rows of ``name`` (less their image id) in the order of images.txt."""
            rows = {r[0]: r[1] if len(r) == 2 else r[1:] for r in table(name, types)}
            missing = [i for i in ids if i not in rows]
            if missing:
                raise DatasetFormatError(f"{os.path.join(root, name)} has no entry for image "
                                         f"id {missing[0]} ({len(missing)} ids missing)")
            return [rows[i] for i in ids]

        images = table("images.txt", (int, str), path_cols=(1,))
        ids, path_of = [i for i, _ in images], dict(images)
        cls = np.array(by_id("image_class_labels.txt", (int, int)))
        is_train = np.array([t == 1 for t in by_id("train_test_split.txt", (int, int))])
        boxes = None
        if bbox_crop:
            # CUB boxes are (x, y, width, height) in pixels.
            boxes = np.array(by_id("bounding_boxes.txt", (int,) + (_finite_float,) * 4),
                             dtype=np.float64).reshape(-1, 4)
            boxes[:, 2:] += boxes[:, :2]
        self._build(root, protocol, split, cls,
                    [os.path.join(root, "images", path_of[i]) for i in ids],
                    lambda: _held_out(cls, is_train, val_fraction, seed), transform,
                    check_files, boxes)


class Cars196(_OfficialImages):
    """Stanford Cars196 (16,185 images, 196 models), the all-in-one ``cars_annos.mat`` layout.

    Args:
        root: folder holding ``car_ims/`` and ``cars_annos.mat`` (fields relative_im_path,
            bbox_x1, bbox_y1, bbox_x2, bbox_y2, class, test).
        split, protocol, transform, bbox_crop, seed, check_files: as for :class:`CUB200`
            ("metric": classes 1-98 train / 99-196 test).
        val_fraction: held-out part of the official training set (the papers: 0.3).
    """

    FIELDS = ("relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test")

    def __init__(self, root: str, split: str = "train", protocol: str = "metric",
                 transform: Optional[Callable] = None, bbox_crop: bool = False,
                 val_fraction: float = 0.3, seed: int = 0, check_files: bool = True):
        _check_split(protocol, split)
        _require(root, "Cars196 root folder", os.path.isdir)
        mat_path = os.path.join(root, "cars_annos.mat")
        mat = _loadmat(mat_path, "Cars196 annotation file cars_annos.mat", ["annotations"])
        ann = np.atleast_1d(mat["annotations"])
        names = ann.dtype.names or ()
        missing = [f for f in self.FIELDS if f not in names]
        if missing:
            raise DatasetFormatError(f"{mat_path}: 'annotations' lacks field(s) {missing}; "
                                     f"found {list(names)}")
        rel = [str(np.asarray(p).reshape(-1)[0]) if np.asarray(p).size else ""
               for p in ann["relative_im_path"]]
        for i, p in enumerate(rel):  # an empty path is refused too, naming its annotation
            _inside_root(p, f"{mat_path}: annotation {i} (relative_im_path)")
        try:
            col = {f: np.array([np.asarray(v).reshape(-1)[0] for v in ann[f]], dtype=np.float64)
                   for f in self.FIELDS[1:]}
        except (IndexError, ValueError, TypeError) as e:
            raise DatasetFormatError(f"{mat_path}: non-numeric annotation field: {e}") from None
        cls = col["class"].astype(np.int64)
        wrong = np.flatnonzero((cls < 1) | (cls != col["class"]))
        if len(wrong):
            bad = int(wrong[0])
            raise DatasetFormatError(f"{mat_path}: annotation {bad} ({rel[bad]}) has class "
                                     f"{col['class'][bad]!r}; the classes are integers from 1")
        is_train = col["test"] == 0

        def boxes(pos):
            xyxy = np.stack([col[f][pos] for f in self.FIELDS[1:5]], axis=1)
            rows = np.flatnonzero(~np.isfinite(xyxy).all(axis=1))
            if len(rows):
                bad = int(pos[rows[0]])
                raise DatasetFormatError(f"{mat_path}: annotation {bad} ({rel[bad]}) has a "
                                         f"non-finite bounding box {xyxy[rows[0]].tolist()}")
            # 1-based inclusive MATLAB pixel coordinates -> PIL's (left, upper, right, lower).
            return xyxy - [1, 1, 0, 0]

        self._build(root, protocol, split, cls, [os.path.join(root, p) for p in rel],
                    lambda: _held_out(cls, is_train, val_fraction, seed), transform,
                    check_files, boxes if bbox_crop else None)


class Flowers102(_OfficialImages):
    """Oxford 102 Flowers (8,189 images) with its official train/val/test split.

    Args:
        root: folder holding ``jpg/image_NNNNN.jpg`` (five digits), ``imagelabels.mat``
            (``labels``, 1..102) and ``setid.mat`` (``trnid``, ``valid``, ``tstid``: 1-based
            image numbers).
        split: "train", "val", "trainval" or "test" (classification; "metric" splits the 102
            classes 51/51 like the other datasets).
        protocol, transform, check_files: as for :class:`CUB200`.
    """

    def __init__(self, root: str, split: str = "train", protocol: str = "classification",
                 transform: Optional[Callable] = None, check_files: bool = True):
        _check_split(protocol, split)
        _require(root, "Flowers102 root folder", os.path.isdir)
        lab_path = os.path.join(root, "imagelabels.mat")
        set_path = os.path.join(root, "setid.mat")
        labels = _int_vector(_loadmat(lab_path, "Flowers102 imagelabels.mat", ["labels"]),
                             "labels", lab_path)
        sets = _loadmat(set_path, "Flowers102 setid.mat", ["trnid", "valid", "tstid"])
        ids = {k: _int_vector(sets, k, set_path) for k in ("trnid", "valid", "tstid")}
        n = len(labels)
        for k, v in ids.items():
            if len(v) and (v.min() < 1 or v.max() > n):
                raise DatasetFormatError(f"{set_path}: {k} holds image number "
                                         f"{v.min() if v.min() < 1 else v.max()} but "
                                         f"{lab_path} labels only {n} images")
        self._build(root, protocol, split, labels,
                    [os.path.join(root, "jpg", f"image_{p + 1:05d}.jpg") for p in range(n)],
                    lambda: {"train": ids["trnid"] - 1, "val": ids["valid"] - 1,
                             "test": ids["tstid"] - 1}, transform, check_files)


class Leafsnap(_OfficialImages):
    """Leafsnap's field images (185 species photographed outdoors).

    Args:
        root: the ``leafsnap-dataset`` folder holding ``leafsnap-dataset-images.txt`` (tab
            separated with a header: file_id, image_path, segmented_path, species, source)
            and the image tree its ``image_path`` column points into (relative to ``root``).
        split: "train", "val", "trainval" or "test" (classification; a seeded per-species
            50/20/30 split, as in the papers) or "train"/"test" (metric, species halves in
            sorted name order).
        protocol, transform, seed, check_files: as for :class:`CUB200`.
    """

    INDEX = "leafsnap-dataset-images.txt"
    COLUMNS = ("file_id", "image_path", "segmented_path", "species", "source")

    def __init__(self, root: str, split: str = "train", protocol: str = "classification",
                 transform: Optional[Callable] = None, seed: int = 0, check_files: bool = True):
        _check_split(protocol, split)
        _require(root, "Leafsnap root folder", os.path.isdir)
        index = os.path.join(root, self.INDEX)
        rows = [r for r in _read_table(index, "Leafsnap index file", (str,) * len(self.COLUMNS),
                                       (1,), "\t", self.COLUMNS) if r[4] == "field"]
        if not rows:
            raise DatasetFormatError(f"{index} lists no images with source == 'field'")
        species = np.array([r[3] for r in rows])
        self._build(root, protocol, split, species, [os.path.join(root, r[1]) for r in rows],
                    lambda: dict(zip(("train", "val", "test"),
                                     stratified_split(species, (0.5, 0.2, 0.3), seed))),
                    transform, check_files)


def as_tensor_labels(ds: ImageListDataset) -> torch.Tensor:
    """(N,) int64 tensor of a dataset's labels (the CentreBank's ``centre_labels``)."""
    return torch.from_numpy(ds.labels.copy())


class IndexedTensorDataset(Dataset):
    """In-memory ``(transform(x[i]), y[i], i)`` items (the same triple as the image datasets).

    Args:
        inputs: (N, ...) tensor of inputs.
        labels: (N,) integer labels in 0..C-1.
        transform: optional function of one input tensor (e.g. a random shift).
    """

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor,
                 transform: Optional[Callable] = None):
        if len(inputs) != len(labels):
            raise ValueError(f"inputs has {len(inputs)} rows but labels has {len(labels)}")
        self.inputs = inputs
        self.labels = torch.as_tensor(labels).long()
        self.num_classes = int(self.labels.max()) + 1 if len(self.labels) else 0
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.inputs[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[i], i


# ---------------------------------------------------------------------------- IDX (MNIST family)
#: IDX element types (the third byte of the magic number) -> big-endian numpy dtype.
IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

#: The four files of every MNIST-format data set (file stem, without ``.gz``), by split.
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


#: How to get one MNIST-format data set (for error messages) and its torchvision folder.
_IDXInfo = namedtuple("_IDXInfo", "name folder get")

IDX_SETS = {
    "fashion-mnist": _IDXInfo("Fashion-MNIST", "FashionMNIST", "install it with `apt-get "
                              "install dataset-fashion-mnist` (files in /usr/share/datasets/"
                              "fashion-mnist) or download the four official files from "
                              "https://github.com/zalandoresearch/fashion-mnist"),
    "mnist": _IDXInfo("MNIST", "MNIST", "download the four official files from "
                      "http://yann.lecun.com/exdb/mnist/"),
    "kmnist": _IDXInfo("KMNIST", "KMNIST", "download the four official files from "
                       "https://github.com/rois-codh/kmnist"),
}


#: The largest IDX payload :func:`read_idx` reads by default; a header declaring more is
#: refused before anything is decompressed.
IDX_MAX_BYTES = 1 << 28
# How far past the declared payload read_idx counts a file's surplus bytes for its message.
_IDX_SURPLUS_COUNTED = 1 << 24


def read_idx(path: str, hint: str = "", max_bytes: int = IDX_MAX_BYTES) -> np.ndarray:
    """One IDX file (gzipped if its name ends in ``.gz``) as a numpy array in native byte order.

    The header is checked against the file (known type, >= 1 dimension, a payload of at most
    ``max_bytes`` and exactly as declared), reading no further than the declared size; any
    mismatch or unreadable gzip raises :class:`DatasetFormatError` naming ``path``, + ``hint``.
    """
    import gzip
    import zlib

    _require(path, "IDX file")
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            dims, dtype, payload = _read_idx_stream(f, path, hint, max_bytes)
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetFormatError(f"{path}: cannot read ({e}){hint}") from None
    arr = np.frombuffer(payload, dtype=dtype).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _read_idx_stream(f, path: str, hint: str, max_bytes: int):
    """(dims, dtype, payload bytes) of the IDX stream ``f``, read as far as its header says."""
    magic = f.read(4)
    if len(magic) < 4:
        raise DatasetFormatError(f"{path}: {len(magic)} bytes, too short for an IDX header{hint}")
    code, ndim = magic[2], magic[3]
    if magic[:2] != b"\0\0" or code not in IDX_DTYPES:
        raise DatasetFormatError(f"{path}: bad IDX magic number 0x{magic.hex()} (expected 0x0000 "
                                 f"then a type byte in {[hex(c) for c in IDX_DTYPES]} and the "
                                 f"dimension count){hint}")
    if ndim < 1:
        raise DatasetFormatError(f"{path}: IDX header gives {ndim} dimensions{hint}")
    sizes = f.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise DatasetFormatError(f"{path}: {4 + len(sizes)} bytes, too short for an IDX header "
                                 f"of {ndim} dimensions{hint}")
    dims = tuple(int(d) for d in np.frombuffer(sizes, dtype=">u4"))
    dtype = IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize  # Python ints: no overflow
    if expected > max_bytes:
        raise DatasetFormatError(f"{path}: header says {dims} items of {dtype.itemsize} byte(s) "
                                 f"= {expected} bytes of data, more than max_bytes = "
                                 f"{max_bytes} (not an IDX file of this family){hint}")
    payload = f.read(expected)  # at most max_bytes
    surplus = 0
    # In bounded steps: a gzip stream may inflate far.
    while surplus <= _IDX_SURPLUS_COUNTED and (chunk := f.read(1 << 20)):
        surplus += len(chunk)
    if len(payload) != expected or surplus:
        held = (f"{len(payload) + surplus}" if surplus <= _IDX_SURPLUS_COUNTED
                else f"more than {expected + _IDX_SURPLUS_COUNTED}")
        raise DatasetFormatError(f"{path}: header says {dims} items of {dtype.itemsize} byte(s) "
                                 f"= {expected} bytes of data, the file holds {held}"
                                 f" (truncated or not this file){hint}")
    return dims, dtype, payload


def find_idx_file(root: str, stem: str, folder: str = "FashionMNIST") -> str:
    """The path of IDX file ``stem`` (raw, else ``stem.gz``) in ``root``, ``root/raw`` or
    ``root/<folder>/raw`` (torchvision's layout); FileNotFoundError lists the places."""
    dirs = (root, os.path.join(root, "raw"), os.path.join(root, folder, "raw"))
    tried = [os.path.join(d, name) for d in dirs for name in (stem, stem + ".gz")]
    for p in tried:
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"{stem}[.gz] not found; looked for {', '.join(tried)}")


class IDXDataset(IndexedTensorDataset):
    """An MNIST-format data set (Fashion-MNIST, MNIST, KMNIST) read from its IDX files; items
    ``(image, label, idx)``: a (1, H, W) float32 image in [0, 1] (or ``transform`` of it), an
    int64 0-dim label and the position. Errors name the file and say how to get the data set.

    Args:
        root: a folder with the four official files, gzipped or not, flat or in
            torchvision's layout (:func:`find_idx_file`).
        split: "train" or "test".
        classes: keep only these official classes, labelled 0.. in the order given; None
            keeps all ten.
        transform: applied to each image tensor.
        name: "fashion-mnist", "mnist" or "kmnist".
    Attributes:
        inputs, labels, num_classes, classes (official ids kept), files.
    """

    NUM_CLASSES = 10

    def __init__(self, root: str, split: str = "train", classes: Optional[Sequence[int]] = None,
                 transform: Optional[Callable] = None, name: str = "fashion-mnist"):
        for arg, value, allowed in (("name", name, IDX_SETS), ("split", split, IDX_FILES)):
            if value not in allowed:
                raise ValueError(f"{arg} must be one of {tuple(allowed)}, got {value!r}")
        info = IDX_SETS[name]
        hint = f"; {info.get}"
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{info.name} folder not found: {root}{hint}")
        try:
            img_path, lab_path = (find_idx_file(root, stem, info.folder)
                                  for stem in IDX_FILES[split])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{info.name} file {e}{hint}") from None
        images = read_idx(img_path, hint)
        labels = read_idx(lab_path, hint)
        if images.ndim != 3 or images.dtype != np.uint8:
            raise DatasetFormatError(f"{img_path}: expected unsigned-byte images of 3 dimensions "
                                     f"(N, H, W), got {images.dtype} of shape {images.shape}{hint}")
        if labels.ndim != 1 or labels.dtype != np.uint8:
            raise DatasetFormatError(f"{lab_path}: expected unsigned-byte labels of 1 dimension, "
                                     f"got {labels.dtype} of shape {labels.shape}{hint}")
        if len(labels) != len(images):
            raise DatasetFormatError(f"{lab_path} holds {len(labels)} labels but {img_path} "
                                     f"holds {len(images)} images{hint}")
        if len(labels) and int(labels.max()) >= self.NUM_CLASSES:
            bad = int(np.flatnonzero(labels >= self.NUM_CLASSES)[0])
            raise DatasetFormatError(f"{lab_path}: label {int(labels[bad])} at item {bad} is "
                                     f"outside 0..{self.NUM_CLASSES - 1}{hint}")
        order = list(range(self.NUM_CLASSES)) if classes is None else [int(c) for c in classes]
        if not order or len(set(order)) != len(order) or \
                any(not 0 <= c < self.NUM_CLASSES for c in order):
            raise ValueError(f"classes must be distinct ints in 0..{self.NUM_CLASSES - 1}, "
                             f"got {list(classes)}")
        keep = np.flatnonzero(np.isin(labels, order))
        lut = np.full(self.NUM_CLASSES, -1, dtype=np.int64)
        lut[order] = np.arange(len(order))
        x = torch.from_numpy(images[keep]).unsqueeze(1).float().div_(255.0)
        super().__init__(x, torch.from_numpy(lut[labels[keep]]), transform)
        self.num_classes = len(order)
        self.classes = order
        self.files = (img_path, lab_path)


def FashionMNIST(root: str, split: str = "train", classes: Optional[Sequence[int]] = None,
                 transform: Optional[Callable] = None) -> IDXDataset:
    """Fashion-MNIST (Xiao et al., 2017): 70,000 28x28 greyscale images of 10 clothing classes.
    See :class:`IDXDataset`."""
    return IDXDataset(root, split, classes, transform, name="fashion-mnist")


def MNIST(root: str, split: str = "train", classes: Optional[Sequence[int]] = None,
          transform: Optional[Callable] = None) -> IDXDataset:
    """MNIST handwritten digits, same format. See :class:`IDXDataset`."""
    return IDXDataset(root, split, classes, transform, name="mnist")


def KMNIST(root: str, split: str = "train", classes: Optional[Sequence[int]] = None,
           transform: Optional[Callable] = None) -> IDXDataset:
    """Kuzushiji-MNIST, same format. See :class:`IDXDataset`."""
    return IDXDataset(root, split, classes, transform, name="kmnist")
