"""Dataset loaders on tiny trees fabricated in the official layouts."""
import gzip
import re
import os
import struct

import numpy as np
import pytest
import torch

from fabricate import make_cars, make_cub, make_flowers, make_leafsnap
from nnkloss.experiment.datasets import (CUB200, Cars196, DatasetFormatError, Flowers102, Leafsnap,
                              stratified_split)


def to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0


def _check_items(ds, n_classes):
    assert len(ds) > 0
    for i in range(len(ds)):
        img, label, idx = ds[i]
        assert idx == i
        assert 0 <= label < n_classes
        assert isinstance(label, int)
    assert set(ds.labels.tolist()) <= set(range(n_classes))
    assert ds.num_classes == n_classes


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {
        "cub": make_cub(str(root / "cub")),
        "cars": make_cars(str(root / "cars")),
        "flowers": make_flowers(str(root / "flowers")),
        "leafsnap": make_leafsnap(str(root / "leafsnap")),
        "root": root,
    }


def test_cub_metric_split(trees):
    tr = CUB200(trees["cub"], "train", protocol="metric", transform=to_tensor)
    te = CUB200(os.path.dirname(trees["cub"]), "test", protocol="metric")  # parent also works
    assert len(tr) == 10 and len(te) == 10  # classes 1-2 / 3-4, 5 images each
    _check_items(tr, 2)
    img, label, idx = tr[0]
    assert img.shape == (3, 30, 40) and img.dtype == torch.float32
    assert "/001.Bird_1/" in tr.paths[0] and "/003.Bird_3/" in te.paths[0]
    assert te.labels.tolist() == [0] * 5 + [1] * 5
    assert set(tr.paths).isdisjoint(te.paths)


def test_cub_classification_split_and_boxes(trees):
    kw = dict(protocol="classification", val_fraction=0.34, seed=3)
    tr = CUB200(trees["cub"], "train", **kw)
    va = CUB200(trees["cub"], "val", **kw)
    tv = CUB200(trees["cub"], "trainval", **kw)
    te = CUB200(trees["cub"], "test", **kw)
    assert len(tv) == 12 and len(te) == 8 and len(tr) + len(va) == 12
    assert len(va) == 4  # round(0.34 * 3) = 1 per class
    assert set(tr.paths).isdisjoint(va.paths) and set(tv.paths).isdisjoint(te.paths)
    _check_items(te, 4)
    assert tr.num_classes == te.num_classes == 4
    # Seeded: same split twice, a different one for another seed (almost surely).
    assert CUB200(trees["cub"], "val", **kw).paths == va.paths
    other = [CUB200(trees["cub"], "val", protocol="classification", val_fraction=0.34,
                    seed=s).paths for s in range(6)]
    assert len({tuple(p) for p in other}) > 1
    boxed = CUB200(trees["cub"], "test", protocol="classification", bbox_crop=True)
    assert boxed.load_image(0).size == (20, 15)  # box x=2 y=3 w=20 h=15 on a 40x30 image
    assert te.load_image(0).size == (40, 30)


def test_cars(trees):
    tr = Cars196(trees["cars"], "train", protocol="metric")
    te = Cars196(trees["cars"], "test", protocol="metric", transform=to_tensor)
    assert len(tr) == 10 and len(te) == 10
    _check_items(te, 2)
    kw = dict(protocol="classification", val_fraction=0.3, seed=0)
    ctr, cva, cte = (Cars196(trees["cars"], s, **kw) for s in ("train", "val", "test"))
    assert len(cte) == 8 and len(ctr) + len(cva) == 12 and len(cva) == 4
    _check_items(ctr, 4)
    boxed = Cars196(trees["cars"], "test", protocol="classification", bbox_crop=True)
    assert boxed.load_image(0).size == (28, 22)  # x1=3..x2=30, y1=4..y2=25, 1-based inclusive


def test_mat_files_inflate_within_a_bound(tmp_path, monkeypatch):
    """scipy's loadmat inflates each compressed element of a MATLAB file whole: imagelabels.mat
    with 64 MiB of zeros beside its labels is a file of ~70 KB. Its elements are inflated and
    counted first, in bounded steps: past MAT_MAX_BYTES (8 MiB here) the file is refused, naming
    it, before scipy reads it. The same annotation files compressed, as the official ones are,
    load as the uncompressed ones do."""
    import scipy.io
    from nnkloss.experiment import datasets
    root = make_flowers(str(tmp_path / "flowers"))
    labels_path = os.path.join(root, "imagelabels.mat")
    labels = scipy.io.loadmat(labels_path)["labels"]
    want = torch.as_tensor(Flowers102(root, "test").labels)
    for name in ("imagelabels.mat", "setid.mat"):   # compressed, as the official files
        path = os.path.join(root, name)
        scipy.io.savemat(path, {k: v for k, v in scipy.io.loadmat(path).items()
                                if not k.startswith("__")}, do_compression=True)
    assert torch.equal(torch.as_tensor(Flowers102(root, "test").labels), want)
    monkeypatch.setattr(datasets, "MAT_MAX_BYTES", 8 << 20)
    assert torch.equal(torch.as_tensor(Flowers102(root, "test").labels), want)
    scipy.io.savemat(labels_path, {"labels": labels, "pad": np.zeros(64 << 20, np.uint8)},
                     do_compression=True)
    assert os.path.getsize(labels_path) < 1 << 20
    raised, peak = _peak_traced(lambda: Flowers102(root, "test"))
    assert isinstance(raised, DatasetFormatError), raised
    assert f"{labels_path}: its compressed elements inflate to more than {8 << 20}" in str(raised)
    assert peak < 16 << 20, peak
    monkeypatch.setattr(datasets, "MAT_MAX_BYTES", 128 << 20)
    assert torch.equal(torch.as_tensor(Flowers102(root, "test").labels), want)


def test_images_beyond_pil_pixel_limit_are_refused_from_their_header(trees, monkeypatch):
    """PIL refuses an image of more than twice Image.MAX_IMAGE_PIXELS, and only warns below:
    the loaders refuse every image above the limit before decoding it (a small compressed file
    can declare gigabytes of pixels), naming the file, whichever of the two it is. The fabricated
    images are 40 x 30 = 1200 pixels."""
    import warnings
    from PIL import Image
    ds = Flowers102(trees["flowers"], "test")
    for limit, match in ((1000, "is 40 x 30 pixels, more than PIL's Image.MAX_IMAGE_PIXELS "
                                "= 1000"),
                         (500, "cannot read image .*exceeds limit")):
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)

            def not_decoded(*a, **k):
                raise AssertionError("decoded")
            m.setattr(Image.Image, "convert", not_decoded)
            with pytest.raises(DatasetFormatError, match=match) as e:
                ds[0]
        assert ds.paths[0] in str(e.value)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1200)
    assert ds[0][0].size == (40, 30)


def test_flowers(trees):
    parts = {s: Flowers102(trees["flowers"], s) for s in ("train", "val", "trainval", "test")}
    assert [len(parts[s]) for s in ("train", "val", "trainval", "test")] == [6, 6, 12, 6]
    _check_items(parts["test"], 3)
    assert parts["train"].paths[0].endswith(os.path.join("jpg", "image_00001.jpg"))
    assert parts["val"].labels.tolist() == [0, 0, 1, 1, 2, 2]
    m = Flowers102(trees["flowers"], "test", protocol="metric")
    assert m.num_classes == 2 and len(m) == 12  # classes 2 and 3 of 3


def test_leafsnap_field_split(trees):
    parts = {s: Leafsnap(trees["leafsnap"], s, seed=1) for s in ("train", "val", "test",
                                                                   "trainval")}
    assert [len(parts[s]) for s in ("train", "val", "test")] == [15, 6, 9]  # 5/2/3 per species
    assert all("/field/" in p for s in parts for p in parts[s].paths)
    _check_items(parts["val"], 3)
    allp = parts["train"].paths + parts["val"].paths + parts["test"].paths
    assert len(set(allp)) == 30
    assert sorted(parts["trainval"].paths) == sorted(parts["train"].paths + parts["val"].paths)


def test_stratified_split_fractions():
    labels = np.repeat(np.arange(5), 20)
    a, b, c = stratified_split(labels, (0.5, 0.2, 0.3), seed=0)
    assert (len(a), len(b), len(c)) == (50, 20, 30)
    assert len(np.intersect1d(a, b)) == 0 and len(np.union1d(np.union1d(a, b), c)) == 100
    for part in (a, b, c):
        assert set(labels[part]) == set(range(5))
    with pytest.raises(ValueError, match="sum to 1"):
        stratified_split(labels, (0.5, 0.2), seed=0)


def test_loader_yields_batches(trees):
    ds = CUB200(trees["cub"], "train", transform=to_tensor)
    x, y, idx = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 3, 30, 40) and y.dtype == torch.int64 and idx.tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------ errors name the file
def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_files_are_named(trees, tmp_path):
    cub = _copy(trees["cub"], str(tmp_path / "CUB_200_2011"))
    os.remove(os.path.join(cub, "train_test_split.txt"))
    with pytest.raises(FileNotFoundError, match="train_test_split.txt"):
        CUB200(cub, "train")
    with pytest.raises(FileNotFoundError, match="cars_annos.mat"):
        Cars196(str(tmp_path), "train")
    fl = _copy(trees["flowers"], str(tmp_path / "fl"))
    os.remove(os.path.join(fl, "setid.mat"))
    with pytest.raises(FileNotFoundError, match="setid.mat"):
        Flowers102(fl, "train")
    with pytest.raises(FileNotFoundError, match="leafsnap-dataset-images.txt"):
        Leafsnap(str(tmp_path), "train")
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        Cars196(str(tmp_path / "no_such_dir"))


def test_missing_image_is_named(trees, tmp_path):
    cars = _copy(trees["cars"], str(tmp_path / "cars"))
    os.remove(os.path.join(cars, "car_ims", "000002.jpg"))
    with pytest.raises(FileNotFoundError, match="000002.jpg"):
        Cars196(cars, "train")
    ds = Cars196(cars, "train", check_files=False)  # deferred: fails on access instead
    with pytest.raises(FileNotFoundError, match="000002.jpg"):
        ds[1]


def test_malformed_files_are_named(trees, tmp_path):
    cub = _copy(trees["cub"], str(tmp_path / "CUB_200_2011"))
    with open(os.path.join(cub, "image_class_labels.txt"), "a") as f:
        f.write("21 3 extra\n")
    with pytest.raises(DatasetFormatError, match=r"image_class_labels.txt, line 21"):
        CUB200(cub, "train")
    with open(os.path.join(cub, "image_class_labels.txt"), "w") as f:
        f.write("1 one\n")
    with pytest.raises(DatasetFormatError, match="image_class_labels.txt"):
        CUB200(cub, "train")

    import scipy.io
    cars = _copy(trees["cars"], str(tmp_path / "cars"))
    scipy.io.savemat(os.path.join(cars, "cars_annos.mat"), {"something_else": np.zeros(3)})
    with pytest.raises(DatasetFormatError, match="cars_annos.mat.*annotations"):
        Cars196(cars, "train")
    # classes are integers from 1: 0 named the last class (class_names[-1]), 2.5 was truncated
    for wrong in (0, 2.5):
        mat = scipy.io.loadmat(os.path.join(trees["cars"], "cars_annos.mat"))
        mat["annotations"][0, 3]["class"] = np.array([[wrong]])
        scipy.io.savemat(os.path.join(cars, "cars_annos.mat"),
                         {k: v for k, v in mat.items() if not k.startswith("__")})
        with pytest.raises(DatasetFormatError, match=r"cars_annos.mat: annotation 3 \(car_ims/"
                                                     r"000004.jpg\) has class .*integers from 1"):
            Cars196(cars, "train")
    with open(os.path.join(cars, "cars_annos.mat"), "w") as f:
        f.write("not a mat file")
    with pytest.raises(DatasetFormatError, match="cars_annos.mat"):
        Cars196(cars, "train")

    fl = _copy(trees["flowers"], str(tmp_path / "fl"))
    scipy.io.savemat(os.path.join(fl, "setid.mat"), {"trnid": np.array([1, 99]),
                                                     "valid": np.array([2]),
                                                     "tstid": np.array([3])})
    with pytest.raises(DatasetFormatError, match="setid.mat.*99"):
        Flowers102(fl, "train")

    leaf = _copy(trees["leafsnap"], str(tmp_path / "leaf"))
    index = os.path.join(leaf, "leafsnap-dataset-images.txt")
    lines = open(index).read().splitlines()
    with open(index, "w") as f:
        f.write("\n".join(lines[:3] + ["7\tonly-two-fields"] + lines[3:]) + "\n")
    with pytest.raises(DatasetFormatError, match=r"leafsnap-dataset-images.txt, line 4"):
        Leafsnap(leaf, "train")
    with open(index, "w") as f:
        f.write("\n".join(lines[1:]) + "\n")  # header missing
    with pytest.raises(DatasetFormatError, match=r"leafsnap-dataset-images.txt, line 1"):
        Leafsnap(leaf, "train")


def test_non_finite_boxes_are_refused_when_the_dataset_is_built(trees, tmp_path):
    """A nan or inf box (float() reads both) was taken, and every read of its image failed at
    the crop with "cannot convert float NaN to integer", in a loader's worker (audit A). Now
    the file is named, with the line or annotation."""
    from nnkloss.experiment.datasets import ImageListDataset
    import scipy.io
    cub = _copy(trees["cub"], str(tmp_path / "CUB_200_2011"))
    box_file = os.path.join(cub, "bounding_boxes.txt")
    lines = open(box_file).read().splitlines()
    for bad in ("nan", "inf"):
        with open(box_file, "w") as f:
            f.write("\n".join(lines[:2] + [f"3 {bad} 0 10 10"] + lines[3:]) + "\n")
        with pytest.raises(DatasetFormatError, match=rf"bounding_boxes.txt, line 3: "
                                                     rf"'{bad}' is not a finite number"):
            CUB200(cub, "train", protocol="classification", bbox_crop=True)
    CUB200(cub, "train", protocol="classification")  # boxes unused: not read
    cars = _copy(trees["cars"], str(tmp_path / "cars"))
    mat = scipy.io.loadmat(os.path.join(cars, "cars_annos.mat"))
    mat["annotations"][0, 0]["bbox_x2"] = np.array([[np.nan]])
    scipy.io.savemat(os.path.join(cars, "cars_annos.mat"),
                     {k: v for k, v in mat.items() if not k.startswith("__")})
    with pytest.raises(DatasetFormatError, match=r"cars_annos.mat: annotation 0 "
                                                 r"\(car_ims/000001.jpg\) has a non-finite"):
        Cars196(cars, "train", bbox_crop=True)
    assert len(Cars196(cars, "train")) == 10
    with pytest.raises(ValueError, match=r"boxes must be finite; item 1 \(b.jpg\)"):
        ImageListDataset(["a.jpg", "b.jpg"], [0, 1], 2,
                         boxes=[[0, 0, 5, 5], [0, 0, float("inf"), 5]])


def test_index_files_that_are_not_text_are_named(trees, tmp_path):
    """A byte that is not UTF-8 in an index file raised a bare UnicodeDecodeError naming no
    file (audit A)."""
    cub = _copy(trees["cub"], str(tmp_path / "CUB_200_2011"))
    with open(os.path.join(cub, "images.txt"), "ab") as f:
        f.write(b"21 \xff\xfe.jpg\n")
    with pytest.raises(DatasetFormatError, match=r"images.txt: not utf-8 text \('utf-8' codec"):
        CUB200(cub, "train")
    leaf = _copy(trees["leafsnap"], str(tmp_path / "leaf"))
    with open(os.path.join(leaf, "leafsnap-dataset-images.txt"), "ab") as f:
        f.write(b"\xff\n")
    with pytest.raises(DatasetFormatError, match=r"leafsnap-dataset-images.txt: not utf-8 text"):
        Leafsnap(leaf, "train")


def test_bad_split_arguments(trees):
    with pytest.raises(ValueError, match="split"):
        CUB200(trees["cub"], "val", protocol="metric")
    with pytest.raises(ValueError, match="protocol"):
        CUB200(trees["cub"], "train", protocol="zero-shot")


# ---------------------------------------------------------------------------- IDX / Fashion-MNIST
from fabricate_idx import idx_bytes, make_idx_tree, write_bytes, write_idx  # noqa: E402
from nnkloss.experiment.datasets import (KMNIST, MNIST, FashionMNIST, IDXDataset,  # noqa: E402
                                         read_idx)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_idx_layouts(tmp_path, gz, layout):
    root = make_idx_tree(str(tmp_path), n_train=40, n_test=20, gz=gz, layout=layout)
    tr = FashionMNIST(root, "train")
    te = FashionMNIST(root, "test")
    assert len(tr) == 40 and len(te) == 20
    assert tr.num_classes == 10 and tr.classes == list(range(10))
    x, y, i = tr[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and float(x.max()) == 1.0
    assert i == 3 and int(y) == int(tr.labels[3])
    # the pixels and labels are exactly the files' bytes
    d = root if layout == "flat" else os.path.join(root, "FashionMNIST", "raw")
    ext = ".gz" if gz else ""
    raw = read_idx(os.path.join(d, "train-images-idx3-ubyte" + ext))
    lab = read_idx(os.path.join(d, "train-labels-idx1-ubyte" + ext))
    assert raw.shape == (40, 28, 28) and raw.dtype == np.uint8
    assert torch.equal((tr.inputs[:, 0] * 255).round().to(torch.uint8), torch.from_numpy(raw))
    assert tr.labels.tolist() == lab.astype(int).tolist()
    assert tr.files[0].endswith("train-images-idx3-ubyte" + ext)


def test_idx_torchvision_parent_and_raw_folder(tmp_path):
    root = make_idx_tree(str(tmp_path), layout="torchvision", folder="MNIST")
    assert len(MNIST(root)) == 60                                   # parent of MNIST/raw
    assert len(MNIST(os.path.join(root, "MNIST"))) == 60            # MNIST/ (holds raw/)
    assert len(MNIST(os.path.join(root, "MNIST", "raw"), "test")) == 30  # raw/ itself
    root_k = make_idx_tree(str(tmp_path / "k"), layout="torchvision", folder="KMNIST")
    assert len(KMNIST(root_k)) == 60
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST file .*FashionMNIST/raw"):
        FashionMNIST(root_k)  # FashionMNIST/raw is not there


def test_idx_prefers_raw_over_gz(tmp_path):
    make_idx_tree(str(tmp_path), gz=True, n_train=20)
    make_idx_tree(str(tmp_path), gz=False, n_train=30)
    assert len(FashionMNIST(str(tmp_path))) == 30
    assert FashionMNIST(str(tmp_path)).files[0].endswith("ubyte")


def test_idx_class_selection_remaps_in_given_order(tmp_path):
    root = make_idx_tree(str(tmp_path), n_train=100)
    full = FashionMNIST(root)
    sub = FashionMNIST(root, classes=[7, 5, 6])
    assert sub.num_classes == 3 and sub.classes == [7, 5, 6]
    assert len(sub) == 30
    lut = {7: 0, 5: 1, 6: 2}
    keep = [i for i, c in enumerate(full.labels.tolist()) if c in lut]
    assert sub.labels.tolist() == [lut[full.labels[i].item()] for i in keep]
    assert torch.equal(sub.inputs, full.inputs[keep])
    assert [sub[j][2] for j in range(len(sub))] == list(range(len(sub)))
    for bad in ([], [1, 1], [10], [-1]):
        with pytest.raises(ValueError, match="classes"):
            FashionMNIST(root, classes=bad)
    with pytest.raises(ValueError, match="split"):
        FashionMNIST(root, split="val")
    with pytest.raises(ValueError, match="name"):
        IDXDataset(root, name="cifar")


def test_idx_transform_applied(tmp_path):
    root = make_idx_tree(str(tmp_path))
    ds = FashionMNIST(root, transform=lambda x: x * 0 + 2)
    assert float(ds[0][0].mean()) == 2.0


def test_read_idx_other_types(tmp_path):
    a = np.arange(24, dtype=">i4").reshape(2, 3, 4) - 5
    p = write_idx(str(tmp_path / "ints"), a, gz=False, code=0x0C)
    got = read_idx(p)
    assert got.dtype == np.dtype("int32") and np.array_equal(got, a)
    f = np.linspace(-1, 1, 6).astype(">f8")
    p = write_idx(str(tmp_path / "f8"), f, gz=True, code=0x0E)
    assert np.array_equal(read_idx(p), f)


def test_idx_missing_file_names_it_and_how_to_get_it(tmp_path):
    root = make_idx_tree(str(tmp_path))
    os.remove(os.path.join(root, "t10k-labels-idx1-ubyte.gz"))
    assert len(FashionMNIST(root, "train")) == 60  # the train files are all there
    with pytest.raises(FileNotFoundError) as e:
        FashionMNIST(root, "test")
    msg = str(e.value)
    assert "t10k-labels-idx1-ubyte" in msg and "apt-get install dataset-fashion-mnist" in msg
    assert "github.com/zalandoresearch/fashion-mnist" in msg
    with pytest.raises(FileNotFoundError, match="MNIST folder not found.*yann.lecun"):
        MNIST(str(tmp_path / "nowhere"))


def _corrupt(root, name, data, gz=True):
    return write_bytes(os.path.join(root, name), data, gz)


IMG, LAB = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
GOOD_IMG = idx_bytes(np.zeros((60, 28, 28), np.uint8))
GOOD_LAB = idx_bytes((np.arange(60) % 10).astype(np.uint8))


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("which, data, match", [
    (IMG, b"\x00\x00", "too short for an IDX header"),
    (IMG, b"\x00\x00\x08\x03\x00\x00", "too short for an IDX header of 3"),
    (IMG, b"\x01" + GOOD_IMG[1:], "bad IDX magic number 0x01000803"),
    (IMG, GOOD_IMG[:2] + b"\x07" + GOOD_IMG[3:], "bad IDX magic"),
    (IMG, GOOD_IMG[:3] + b"\x00" + GOOD_IMG[4:], "0 dimensions"),
    (IMG, GOOD_IMG[:-1], r"47040 bytes of data, the file holds 47039"),
    (IMG, GOOD_IMG + b"\x00", "the file holds 47041"),
    (IMG, idx_bytes(np.zeros((60, 784), np.uint8)), "3 dimensions"),
    (IMG, idx_bytes(np.zeros((60, 28, 28), ">i4"), code=0x0C), "unsigned-byte images"),
    (LAB, idx_bytes(np.zeros((60, 1), np.uint8)), "1 dimension"),
    (LAB, idx_bytes(np.zeros(59, np.uint8)), "holds 59 labels but .* holds 60 images"),
    (LAB, idx_bytes(np.r_[np.zeros(59), 10].astype(np.uint8)), "label 10 at item 59"),
])
def test_idx_corrupt_files(tmp_path, gz, which, data, match):
    root = make_idx_tree(str(tmp_path), gz=gz)
    path = _corrupt(root, which, data, gz)
    with pytest.raises(DatasetFormatError, match=match) as e:
        FashionMNIST(root, "train")
    msg = str(e.value)
    assert path in msg and "apt-get install dataset-fashion-mnist" in msg


def test_idx_broken_gzip_stream(tmp_path):
    root = make_idx_tree(str(tmp_path), gz=True)
    path = os.path.join(root, IMG + ".gz")
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])  # truncated download
    with pytest.raises(DatasetFormatError, match="cannot read") as e:
        FashionMNIST(root)
    assert path in str(e.value)
    with open(path, "wb") as f:
        f.write(b"not gzip at all" * 10)
    with pytest.raises(DatasetFormatError, match="cannot read"):
        FashionMNIST(root)


def _peak_traced(fn):
    """(what fn raised, the peak bytes Python allocated meanwhile), by tracemalloc."""
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        raised = exc
    else:
        raised = None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return raised, peak


@pytest.mark.parametrize("gz", [True, False])
def test_idx_header_declaring_too_much_is_refused_before_the_payload(tmp_path, gz):
    """A header declaring more than max_bytes (default IDX_MAX_BYTES, 256 MiB) is refused before
    any payload is read: 65536 x 65536 x 2 bytes of >i2 here, 8 GiB, from a file of 16 bytes,
    and 512 MiB of bytes (a payload that would peak near 3 GiB once read and converted)."""
    from nnkloss.experiment.datasets import IDX_MAX_BYTES
    assert 60000 * 28 * 28 <= IDX_MAX_BYTES <= 1 << 28
    for name, code, dims in (("huge", 0x0B, (65536, 65536)), ("big", 0x08, (8192, 65536))):
        head = bytes([0, 0, code, 2]) + struct.pack(">II", *dims)
        path = write_bytes(str(tmp_path / name), head + b"\x00" * 4, gz)
        raised, peak = _peak_traced(lambda: read_idx(path))
        assert isinstance(raised, DatasetFormatError), raised
        assert path in str(raised) and f"more than max_bytes = {IDX_MAX_BYTES}" in str(raised)
        assert peak < 1 << 20
    # max_bytes is the caller's: the real training images (47 MB) pass the default, and a
    # smaller bound refuses them
    good = write_idx(str(tmp_path / "img"), np.zeros((60, 28, 28), np.uint8), gz)
    assert read_idx(good).shape == (60, 28, 28)
    with pytest.raises(DatasetFormatError, match="47040 bytes of data, more than max_bytes"):
        read_idx(good, max_bytes=47039)


def test_idx_gzip_bomb_is_read_only_as_far_as_its_header(tmp_path):
    """A gzip stream that inflates far beyond its header's payload (64 MiB of zeros behind a
    header of 10 bytes, a 64 KB file) is refused after reading the payload and at most 16 MiB
    more, in 1 MiB steps: Python's peak allocation stays a few MB (f.read() of the whole
    stream, as before, held all 64 MiB)."""
    path = str(tmp_path / "train-labels-idx1-ubyte.gz")
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(idx_bytes(np.arange(10, dtype=np.uint8)))
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert os.path.getsize(path) < 1 << 20
    raised, peak = _peak_traced(lambda: read_idx(path))
    assert isinstance(raised, DatasetFormatError), raised
    assert f"10 bytes of data, the file holds more than {10 + (1 << 24)}" in str(raised)
    assert peak < 8 << 20, peak


def test_the_package_docstring_lists_every_loader():
    """nnkloss.experiment's docstring names every public data set class and loader function
    of datasets.py (the IDX loaders were missing before issue 19)."""
    import inspect
    import typing
    import nnkloss.experiment as experiment
    from nnkloss.experiment import datasets
    from torch.utils.data import Dataset
    loaders = []
    for name in datasets.__all__:
        obj = getattr(datasets, name)
        if inspect.isclass(obj) and issubclass(obj, Dataset):
            loaders.append(name)
        elif inspect.isfunction(obj):
            ret = typing.get_type_hints(obj).get("return")
            if inspect.isclass(ret) and issubclass(ret, Dataset):
                loaders.append(name)
    assert {"CUB200", "IDXDataset", "FashionMNIST", "MNIST", "KMNIST"} <= set(loaders)
    missing = [n for n in loaders if n not in experiment.__doc__]
    assert not missing, f"not in nnkloss.experiment's docstring: {missing}"


def test_index_entries_that_leave_the_dataset_folder_are_refused(trees, tmp_path):
    """Image paths come from index files on disk: an absolute path, or one with '..'
    components, was joined to the root and read a file outside the dataset (os.path.join
    drops the root before an absolute path). Now refused, naming the file, line and entry."""
    import scipy.io
    outside = str(tmp_path / "outside.jpg")
    cub = _copy(trees["cub"], str(tmp_path / "CUB_200_2011"))
    images = os.path.join(cub, "images.txt")
    lines = open(images).read().splitlines()
    for entry in ("../../outside.jpg", outside, "001.Bird_1/../../../outside.jpg",
                  "..\\..\\outside.jpg"):
        with open(images, "w") as f:
            f.write("\n".join(lines[:2] + [f"3 {entry}"] + lines[3:]) + "\n")
        with pytest.raises(DatasetFormatError, match=r"images.txt, line 3: image path "
                                                     + re.escape(repr(entry))):
            CUB200(cub, "train", check_files=False)

    cars = _copy(trees["cars"], str(tmp_path / "cars"))
    for entry in ("../outside.jpg", outside, ""):
        mat = scipy.io.loadmat(os.path.join(trees["cars"], "cars_annos.mat"))
        mat["annotations"][0, 2]["relative_im_path"] = np.array([entry])
        scipy.io.savemat(os.path.join(cars, "cars_annos.mat"),
                         {k: v for k, v in mat.items() if not k.startswith("__")})
        with pytest.raises(DatasetFormatError, match=r"cars_annos.mat: annotation 2 "
                                                     r"\(relative_im_path\): "
                                                     + (f"image path {re.escape(repr(entry))}"
                                                        if entry else "empty image path")):
            Cars196(cars, "train", check_files=False)

    leaf = _copy(trees["leafsnap"], str(tmp_path / "leaf"))
    index = os.path.join(leaf, "leafsnap-dataset-images.txt")
    lines = open(index).read().splitlines()
    for entry in ("dataset/../../outside.jpg", outside):
        row = lines[2].split("\t")
        row[1] = entry
        with open(index, "w") as f:
            f.write("\n".join(lines[:2] + ["\t".join(row)] + lines[3:]) + "\n")
        with pytest.raises(DatasetFormatError, match=r"leafsnap-dataset-images.txt, line 3 "
                                                     r"\(image_path\): image path "
                                                     + re.escape(repr(entry))):
            Leafsnap(leaf, "train", check_files=False)
    # names that merely contain dots stay allowed
    with open(index, "w") as f:
        row = lines[2].split("\t")
        row[1] = row[1].replace(".jpg", "..jpg")
        f.write("\n".join(lines[:2] + ["\t".join(row)] + lines[3:]) + "\n")
    Leafsnap(leaf, "train", check_files=False)


def test_boxes_are_rounded_and_clipped_to_the_image(tmp_path):
    """A box past the image's edges is clipped to them; one empty after clipping keeps the
    whole image."""
    from PIL import Image
    from nnkloss.experiment.datasets import ImageListDataset
    path = str(tmp_path / "a.png")
    Image.new("RGB", (40, 30)).save(path)
    boxes = [[-5, 2.6, 50, 20.4], [10, 5, 10, 20], [45, 0, 60, 30], [-9, -9, -1, 30]]
    ds = ImageListDataset([path] * 4, [0] * 4, 1, boxes=boxes)
    assert [ds.load_image(i).size for i in range(4)] == [(40, 17), (40, 30), (40, 30), (40, 30)]
