"""The reproduction scripts end to end, in-process through their main(argv), on tiny inputs."""
import importlib.util
import json
import re
import os

import pytest
import torch

from fabricate import make_cars, make_cub, make_flowers, make_leafsnap

REPRO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "repro")


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"repro_{name}", os.path.join(REPRO, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


METRIC_KEYS = {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision",
               "nmi"}


def _fraction(v):
    return isinstance(v, float) and 0.0 <= v <= 1.0


def test_digits_quick(tmp_path, capsys):
    digits = load_script("digits")
    out = tmp_path / "digits"
    # --device auto: the device start_run chose reaches the runs ("auto" itself crashed there)
    results = digits.main(["--out", str(out), "--quick", "--no-progress", "--device", "auto"])
    on_disk = json.load(open(out / "results.json"))
    assert on_disk == results
    assert set(on_disk) == {"metric_learning", "classification"}
    # The raw-pixel floor beside the trained networks, in the files and the printed table.
    assert set(on_disk["metric_learning"]) == {"nngk", "softmax", "pixels"}
    printed = capsys.readouterr().out
    assert re.search(r"\| pixels +\|", printed) and f"Files written to {out}" in printed
    for loss in ("nngk", "softmax", "pixels"):
        assert set(on_disk["metric_learning"][loss]) == METRIC_KEYS
        assert all(_fraction(v) for v in on_disk["metric_learning"][loss].values())
        assert set(on_disk["classification"][loss]) == {"accuracy"}
        assert _fraction(on_disk["classification"][loss]["accuracy"])
    for png in ("embedding_nngk.png", "embedding_softmax.png", "recall.png",
                "training_curves.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    assert "R@1" in open(out / "results.md").read() and "MAP@R" in open(out / "results.md").read()
    # The kernel runs went through the Refresher: bank refreshes are in their logs.
    log = json.load(open(out / "metric_nngk" / "log.json"))
    assert "start_refresh_time_s" in log[0] and log[0]["counted_frac"] > 0.5


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro_data")
    return {"cub": make_cub(str(root / "cub"), n_classes=4, per_class=6),
            "cars": make_cars(str(root / "cars"), n_classes=4, per_class=6),
            "flowers": make_flowers(str(root / "flowers")),
            "leafsnap": make_leafsnap(str(root / "leafsnap"), per_class=6)}


TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--workers", "0",
        "--update-interval", "1", "--no-progress"]


@pytest.mark.parametrize("dataset", ["cub", "cars"])
def test_metric_learning_one_epoch(trees, tmp_path, dataset):
    ml = load_script("metric_learning")
    out = tmp_path / "ml"
    argv = ["--dataset", dataset, "--data-root", trees[dataset], "--out", str(out),
            "--dim", "16", "--image-size", "32", "--embedding-plot", "pca"] + TINY
    results = ml.main(argv)
    on_disk = json.load(open(out / "results.json"))
    assert on_disk == json.loads(json.dumps(results))
    (run,) = on_disk["runs"]
    assert run["dim"] == 16 and run["epochs"] == 1
    assert all(_fraction(run[k]) for k in METRIC_KEYS)
    assert run["k"] == 11  # K=100 clamped to the 12 training images - 1
    assert run["sigma"] == 10.0
    assert run["train_images"] == 12 and run["test_images"] == 12
    table = open(out / "results.md").read()
    assert "Ours (this run)" in table and "Ours (paper)" in table and "MAP@R" in table
    for f in ("recall.png", "dim16/embedding.png", "dim16/training_curves.png",
              "dim16/log.csv", "dim16/checkpoint.pt"):
        assert os.path.isfile(out / f), f
    if dataset == "cub":
        # Rerunning resumes from the checkpoint: no new epoch, same numbers.
        again = ml.main(argv)
        assert again["runs"][0]["recall@1"] == pytest.approx(run["recall@1"])
        assert len(json.load(open(out / "dim16" / "log.json"))) == 1


def test_metric_learning_and_classification_resume_only_their_own_settings(trees, tmp_path,
                                                                          capsys):
    """A checkpoint of other settings, or of more epochs, is not resumed as this run. Before,
    metric_learning at --epochs 2, then again at --epochs 1 --sigma 3 into the same --out:
    results.json said 1 epoch at sigma 3 for the 2-epoch sigma-10 model (the same numbers);
    classification.py alike."""
    ml = load_script("metric_learning")
    out = tmp_path / "ml"
    argv = ["--dataset", "cub", "--data-root", trees["cub"], "--out", str(out), "--dim", "16",
            "--image-size", "32", "--embedding-plot", "none"] + TINY
    ml.main(argv)
    with pytest.raises(SystemExit, match=r"sigma: 10\.0, now 3\.0"):
        ml.main(argv + ["--sigma", "3"])
    with pytest.raises(SystemExit, match="--restart"):
        ml.main(argv + ["--lr", "1e-3"])
    # the default sigma named: the same setting, resumed; more epochs continue the run
    again = ml.main(argv + ["--sigma", "10", "--epochs", "2"])
    assert again["runs"][0]["epochs"] == 2
    assert len(json.load(open(out / "dim16" / "log.json"))) == 2
    with pytest.raises(SystemExit, match="2 epochs, more than --epochs 1"):
        ml.main(argv)
    assert ml.main(argv + ["--sigma", "3", "--restart"])["runs"][0]["sigma"] == 3.0
    assert len(json.load(open(out / "dim16" / "log.json"))) == 1

    cl = load_script("classification")
    out = tmp_path / "cls"
    argv = ["--dataset", "cub", "--data-root", trees["cub"], "--out", str(out), "--arch",
            "resnet50", "--image-size", "32", "--loss", "softmax"] + TINY
    cl.main(argv)
    with pytest.raises(SystemExit, match="softmax_lr"):
        cl.main(argv + ["--softmax-lr", "1e-2"])
    assert cl.main(argv + ["--workers", "0", "--eval-every", "1"])["runs"]["softmax"]


def test_a_restart_stopped_before_its_first_epoch_does_not_leave_the_old_run_to_resume(
        trees, tmp_path, monkeypatch):
    """metric_learning --restart with other settings, stopped before its first epoch ended:
    the next invocation (same settings, no --restart) resumed the OLD run's checkpoint as the
    new run (the new settings.json stood beside it). Now it starts afresh."""
    from nnkloss.experiment.train import Trainer
    ml = load_script("metric_learning")
    out = tmp_path / "ml"
    argv = ["--dataset", "cub", "--data-root", trees["cub"], "--out", str(out), "--dim", "16",
            "--image-size", "32", "--embedding-plot", "none"] + TINY
    ml.main(argv)
    fit = Trainer.fit

    def stopped(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", stopped)
    with pytest.raises(KeyboardInterrupt):
        ml.main(argv + ["--sigma", "3", "--restart"])
    monkeypatch.setattr(Trainer, "fit", fit)

    def resumed(self, *a, **k):
        raise AssertionError("the old run's checkpoint was resumed as the new run")

    monkeypatch.setattr(Trainer, "load_checkpoint", resumed)
    assert ml.main(argv + ["--sigma", "3"])["runs"][0]["sigma"] == 3.0


def test_scripts_refuse_epochs_below_one(tmp_path, capsys):
    """Before, digits.py --epochs 0 (or -1) reported untrained networks as its results, and
    metric_learning.py / classification.py failed after building everything (IndexError)."""
    cases = {"digits": ["--out", str(tmp_path)],
             "metric_learning": ["--dataset", "cub", "--data-root", "x", "--out", str(tmp_path)],
             "classification": ["--dataset", "cub", "--data-root", "x", "--out", str(tmp_path)]}
    for name, argv in cases.items():
        script = load_script(name)
        for epochs in ("0", "-1"):
            with pytest.raises(SystemExit):
                script.parse_args(argv + ["--epochs", epochs])
            assert "--epochs must be >= 1" in capsys.readouterr().err, name
        assert script.parse_args(argv + ["--epochs", "1"]).epochs == 1


def test_metric_learning_sigma_default():
    ml = load_script("metric_learning")
    assert [ml.default_sigma(d) for d in (64, 128, 256, 512, 1024)] == [10, 15, 20, 25, 30]
    assert ml.parse_args(["--dataset", "cars", "--data-root", "x", "--out", "y"]).epochs == 50
    assert ml.parse_args(["--dataset", "cub", "--data-root", "x", "--out", "y"]).epochs == 30


def test_classification_cub_resnet50_both_losses(trees, tmp_path):
    cl = load_script("classification")
    out = tmp_path / "cls"
    results = cl.main(["--dataset", "cub", "--data-root", trees["cub"], "--out", str(out),
                       "--arch", "resnet50", "--image-size", "32"] + TINY)
    on_disk = json.load(open(out / "results.json"))
    assert on_disk["bbox_crop"] is True and on_disk["num_classes"] == 4
    assert on_disk["sizes"] == {"train": 12 - 4, "val": 4, "test": 12}  # 20% of 3 per class
    for loss in ("nngk", "softmax"):
        r = on_disk["runs"][loss]
        assert _fraction(r["val_accuracy"]) and _fraction(r["test_accuracy"])
        assert r["val_loss"] >= 0
    assert on_disk["runs"]["nngk"]["learned_weights"] is True
    assert on_disk["paper"] == {"softmax": pytest.approx(0.7805), "nngk": pytest.approx(0.7898)}
    assert results["runs"]["nngk"]["sigma"] == pytest.approx(100 / 2 ** 0.5)
    assert "Test acc" in open(out / "results.md").read()
    assert os.path.isfile(out / "nngk" / "training_curves.png")


@pytest.mark.parametrize("dataset", ["flowers", "leafsnap"])
def test_classification_alexnet_other_datasets(trees, tmp_path, dataset):
    cl = load_script("classification")
    out = tmp_path / dataset
    results = cl.main(["--dataset", dataset, "--data-root", trees[dataset], "--out", str(out),
                       "--arch", "alexnet", "--image-size", "64", "--loss", "nngk"] + TINY)
    assert set(results["runs"]) == {"nngk"}
    assert results["num_classes"] == 3
    assert _fraction(results["runs"]["nngk"]["test_accuracy"])


def test_classification_rejects_too_small_images(trees, tmp_path):
    cl = load_script("classification")
    with pytest.raises(SystemExit):
        cl.parse_args(["--dataset", "cub", "--data-root", trees["cub"], "--out", str(tmp_path),
                       "--arch", "alexnet", "--image-size", "32"])


# ------------------------------------------------------------------ models
def test_models_accept_small_inputs_and_output_dims():
    from nnkloss.experiment.models import DigitsNet, build_embedding_net

    net = DigitsNet(dim=8).eval()
    assert net(torch.rand(3, 64)).shape == (3, 8)
    for arch, size, dim in (("googlenet", 32, 16), ("resnet50", 32, 2048)):
        m = build_embedding_net(arch, dim=16 if arch == "googlenet" else None).eval()
        with torch.no_grad():
            assert m(torch.randn(2, 3, size, size)).shape == (2, dim)


def test_pretrained_weights_from_a_local_file(tmp_path):
    from torchvision import models

    from nnkloss.experiment.models import build_embedding_net

    src = models.googlenet(weights=None, aux_logits=True, init_weights=True)  # torchvision layout
    path = tmp_path / "googlenet.pth"
    torch.save(src.state_dict(), path)
    net = build_embedding_net("googlenet", dim=8, pretrained=str(path))
    assert torch.equal(net.backbone.conv1.conv.weight, src.conv1.conv.weight)
    assert net.backbone.transform_input  # what torchvision's ImageNet weights expect
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        build_embedding_net("googlenet", dim=8, pretrained=str(tmp_path / "missing.pth"))
    bad = tmp_path / "resnet_for_googlenet.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, bad)
    with pytest.raises(ValueError, match="resnet_for_googlenet.pth.*missing keys"):
        build_embedding_net("googlenet", dim=8, pretrained=str(bad))
    int_keys = tmp_path / "int_keys.pth"  # a non-str key: an AttributeError naming nothing
    torch.save({0: torch.zeros(1)}, int_keys)
    with pytest.raises(ValueError, match=r"int_keys.pth does not hold a state dict of tensors"):
        build_embedding_net("googlenet", dim=8, pretrained=str(int_keys))
    # weights-only, and no record may inflate beyond the file (a zip bomb): the same weights
    # with their records deflated are refused, naming the file
    import zipfile
    deflated = tmp_path / "deflated.pth"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(deflated, "w") as dst:
        for info in src.infolist():
            dst.writestr(zipfile.ZipInfo(info.filename), src.read(info.filename),
                         compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(ValueError, match=r"pretrained weights .*deflated.pth cannot be read "
                                         r"safely: its record '[^']+' is compressed"):
        build_embedding_net("googlenet", dim=8, pretrained=str(deflated))


def test_metric_learning_small_test_split_keeps_the_run(tmp_path):
    """A test split of 2 classes x 3 images (N = 6 < 8 + 1): Recall@8 cannot exist. The script
    must report the Ks that do, say which were skipped, and still write its results."""
    root = make_cub(str(tmp_path / "cub"), n_classes=4, per_class=3)
    ml = load_script("metric_learning")
    out = tmp_path / "ml"
    argv = ["--dataset", "cub", "--data-root", root, "--out", str(out), "--dim", "8",
            "--image-size", "32", "--embedding-plot", "none"] + TINY
    with pytest.warns(UserWarning, match=r"Recall@K for K = \[8\] skipped"):
        results = ml.main(argv)
    (run,) = json.load(open(out / "results.json"))["runs"]
    assert run == json.loads(json.dumps(results["runs"][0]))
    assert run["test_images"] == 6
    assert run["recall@8"] is None
    assert all(_fraction(run[f"recall@{k}"]) for k in (1, 2, 4)) and _fraction(run["nmi"])
    assert "| -" in open(out / "results.md").read().replace("  ", " ")
    assert os.path.isfile(out / "recall.png")


# ---------------------------------------------------------------------------- Fashion-MNIST
@pytest.fixture(scope="module")
def idx_tree(tmp_path_factory):
    from fabricate_idx import make_idx_tree
    return make_idx_tree(str(tmp_path_factory.mktemp("fmnist")), n_train=200, n_test=100)


FM_TINY = ["--epochs", "1", "--batch-size", "16", "--nngk-k", "5", "--no-progress",
           "--dim", "8", "--width", "4", "--nmi-inits", "2"]
FM_KEYS = {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi"}


def test_fashion_mnist_retrieval_quick_and_resume(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    out = tmp_path / "fm"
    methods = ["nngk", "contrastive", "triplet", "proxyanchor", "softmax", "pixels"]
    argv = ["--data-root", idx_tree, "--out", str(out), "--quick", "--methods", *methods,
            "--seeds", "0", "1"] + FM_TINY
    results = fm.main(argv)
    on_disk = json.load(open(out / "results.json"))
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["protocol"] == "retrieval" and on_disk["runs_skipped_as_done"] == 0
    assert set(on_disk["runs"]) == {f"{m}/s{s}" for m in methods for s in (0, 1)}
    for key, run in on_disk["runs"].items():
        assert set(run["metrics"]) >= FM_KEYS, key
        assert all(_fraction(run["metrics"][k]) for k in FM_KEYS), key
        cfg = run["config"]
        assert cfg["train_classes"] == [0, 1, 2, 3, 4] and cfg["eval_classes"] == [5, 6, 7, 8, 9]
        assert cfg["train_images"] == 100 and cfg["eval_images"] == 50
        assert run["wall_s"] >= run["train_time_s"] >= 0.0 and len(run["load_start"]) == 3
    # every trained method had the same set-up; each its own settings
    runs = on_disk["runs"]
    assert runs["triplet/s0"]["config"]["pml"]["miner_args"]["type_of_triplets"] == "semihard"
    assert runs["proxyanchor/s0"]["config"]["loss_lr"] == 1e-2
    assert runs["nngk/s0"]["config"]["nngk"]["k"] == 5
    assert runs["nngk/s0"]["history"][0]["counted_frac"] > 0
    for m in ("nngk", "contrastive", "softmax"):
        c = dict(runs[f"{m}/s0"]["config"])
        assert (c["lr"], c["batch_size"], c["epochs"]) == (1e-3, 16, 1)
    # pixels need no seed: the same numbers for both (NMI's k-means aside)
    assert runs["pixels/s0"]["metrics"]["recall@1"] == runs["pixels/s1"]["metrics"]["recall@1"]
    summ = on_disk["summary"]["contrastive"]
    vals = [runs[f"contrastive/s{s}"]["metrics"]["recall@1"] for s in (0, 1)]
    assert summ["seeds"] == [0, 1]
    assert summ["recall@1"]["mean"] == pytest.approx(sum(vals) / 2)
    assert summ["recall@1"]["std"] == pytest.approx(abs(vals[0] - vals[1]) / 2 ** 0.5)
    with open(out / "recall.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    rows = open(out / "summary.csv").read().splitlines()
    assert rows[0].startswith("method,seeds,recall@1_mean") and len(rows) == 1 + len(methods)
    assert "MAP@R" in open(out / "results.md").read()

    # resumed: nothing re-run, same numbers
    again = fm.main(argv)
    assert again["runs_skipped_as_done"] == len(methods) * 2
    assert again["runs"] == on_disk["runs"]
    # a changed NNGK option re-runs only the NNGK runs
    third = fm.main(argv + ["--nngk-sigma", "0.5"])
    assert third["runs_skipped_as_done"] == (len(methods) - 1) * 2
    assert third["runs"]["nngk/s0"]["config"]["nngk"]["sigma"] == "0.5"
    assert third["runs"]["contrastive/s1"] == on_disk["runs"]["contrastive/s1"]
    # a tagged NNGK variant is kept beside the others and reported with them
    tagged = fm.main(["--data-root", idx_tree, "--out", str(out), "--quick", "--methods",
                      "nngk", "--seeds", "0", "1", "--tag", "k3"] + FM_TINY
                     + ["--nngk-k", "3"])
    assert tagged["runs_skipped_as_done"] == 0
    assert tagged["runs"]["nngk-k3/s1"]["config"]["nngk"]["k"] == 3
    assert tagged["runs"]["nngk/s1"]["config"]["nngk"]["k"] == 5
    assert list(tagged["summary"])[:2] == ["nngk-k3", "nngk"]
    assert set(tagged["summary"]) == {"nngk-k3"} | set(methods)
    assert "nngk-k3" in open(out / "results.md").read()
    assert os.path.isdir(out / "runs" / "nngk-k3-s0")


def test_fashion_mnist_network_memory_format(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    # channels_last changes strides only: the same weights give the same embeddings
    torch.manual_seed(0)
    a = fm.SmallCNN(8, 4, normalise=True).eval()
    b = fm.SmallCNN(8, 4, normalise=True)
    b.load_state_dict(a.state_dict())
    b = b.eval().to(memory_format=torch.channels_last)
    assert b.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.rand(5, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-4)
    # each run records its format; the other format is another configuration (re-run)
    argv = ["--data-root", idx_tree, "--out", str(tmp_path / "fm"), "--quick", "--methods",
            "softmax", "--seeds", "0"] + FM_TINY
    first = fm.main(argv)
    assert first["runs"]["softmax/s0"]["config"]["memory_format"] == "channels_last"
    other = fm.main(argv + ["--memory-format", "contiguous"])
    assert other["runs_skipped_as_done"] == 0
    assert other["runs"]["softmax/s0"]["config"]["memory_format"] == "contiguous"


def test_fashion_mnist_damaged_records_are_run_again_or_left_out(idx_tree, tmp_path):
    """A run's result.json that is not a record of this script (a JSON list, a dict without
    its fields, junk) is run again, not read; other folders' such files are left out of the
    report. Before, a list as the run's own record raised AttributeError and a record without
    "method" KeyError."""
    fm = load_script("fashion_mnist")
    out = tmp_path / "fm"
    argv = ["--data-root", idx_tree, "--out", str(out), "--quick", "--methods", "softmax",
            "--seeds", "0"] + FM_TINY
    first = fm.main(argv)["runs"]["softmax/s0"]
    (out / "runs" / "softmax-s0" / "result.json").write_text("[1, 2]")
    for name, text in (("junk-s0", "{not json"), ("list-s0", "[]"),
                       ("nomethod-s0", json.dumps({"config": first["config"], "seed": 0}))):
        os.makedirs(out / "runs" / name)
        (out / "runs" / name / "result.json").write_text(text)
    again = fm.main(argv)
    assert again["runs_skipped_as_done"] == 0 and set(again["runs"]) == {"softmax/s0"}
    assert again["runs"]["softmax/s0"]["metrics"] == first["metrics"]


def test_fashion_mnist_summary_never_mixes_configurations_of_one_name(idx_tree, tmp_path):
    """A run of another configuration kept under the same name is not averaged in. Before,
    nngk seeds 0 1 at sigma 0.2, then nngk seed 0 at sigma 0.5 into the same folder: the "nngk"
    row was the mean of seed 0 at sigma 0.5 and seed 1 at sigma 0.2."""
    fm = load_script("fashion_mnist")
    out = tmp_path / "fm"
    argv = ["--data-root", idx_tree, "--out", str(out), "--quick", "--methods", "nngk"] + FM_TINY
    fm.main(argv + ["--seeds", "0", "1"])
    res = fm.main(argv + ["--seeds", "0", "--nngk-sigma", "0.5"])
    assert set(res["runs"]) == {"nngk/s0"}
    assert res["summary"]["nngk"]["seeds"] == [0]
    # another invocation's report shows each name's newest configuration only
    other = fm.main(["--data-root", idx_tree, "--out", str(out), "--quick", "--methods",
                     "pixels", "--seeds", "0"] + FM_TINY)
    assert other["summary"]["nngk"]["seeds"] == [0]
    assert other["runs"]["nngk/s0"]["config"]["nngk"]["sigma"] == "0.5"


def test_fashion_mnist_interrupted_run_resumes_from_its_checkpoint(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    out = tmp_path / "fm"
    argv = ["--data-root", idx_tree, "--out", str(out), "--quick", "--methods", "softmax",
            "--seeds", "0"] + FM_TINY
    first = fm.main(argv)["runs"]["softmax/s0"]
    os.remove(out / "runs" / "softmax-s0" / "result.json")  # as if killed after training
    second = fm.main(argv)["runs"]["softmax/s0"]
    assert second["metrics"] == first["metrics"]
    assert second["history"] == first["history"]  # the checkpoint's log, not a new run


def test_fashion_mnist_classification_quick(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    out = tmp_path / "fc"
    res = fm.main(["--data-root", idx_tree, "--out", str(out), "--quick", "--protocol",
                   "classification", "--seeds", "0"] + FM_TINY)
    assert set(res["runs"]) == {"nngk/s0", "softmax/s0", "pixels/s0"}
    for run in res["runs"].values():
        assert _fraction(run["metrics"]["accuracy"])
        assert run["config"]["eval_classes"] == list(range(10))
        assert run["config"]["eval_images"] == 100
    # the fabricated classes are easy: 1-NN on pixels gets them all
    assert res["runs"]["pixels/s0"]["metrics"]["accuracy"] > 0.9
    with open(out / "accuracy.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_fashion_mnist_validation_never_reads_the_test_images(idx_tree, tmp_path):
    import shutil
    fm = load_script("fashion_mnist")
    data = tmp_path / "train_only"
    shutil.copytree(idx_tree, data)
    for f in os.listdir(data):
        if f.startswith("t10k"):
            os.remove(data / f)
    for protocol, key in (("retrieval", "val_map@r"), ("classification", "val_accuracy")):
        res = fm.main(["--data-root", str(data), "--out", str(tmp_path / protocol),
                       "--protocol", protocol, "--eval-on", "val", "--curve", "--methods",
                       "nngk", "softmax", "--seeds", "0"] + FM_TINY)
        run = res["runs"]["nngk/s0"]
        assert "validation" in run["config"]["eval_split"]
        assert key in run["history"][-1]
        assert all("t10k" not in p for p in res["data_files"])
    ret = json.load(open(tmp_path / "retrieval" / "results.json"))
    assert ret["config"]["train_classes"] == [0, 1, 2]
    assert ret["config"]["eval_classes"] == [3, 4]
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        fm.main(["--data-root", str(data), "--out", str(tmp_path / "t"), "--quick"] + FM_TINY)


def test_fashion_mnist_bad_arguments(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    base = ["--data-root", idx_tree, "--out", str(tmp_path)]
    for extra in (["--curve"], ["--train-classes", "0", "0"], ["--train-classes", "10"],
                  ["--epochs", "0"], ["--nngk-sigma", "-1"], ["--methods", "siamese"],
                  ["--eval-on", "val", "--val-classes", "5"], ["--tag", "a/b"], ["--tag", ""],
                  ["--device", "gpu"]):
        with pytest.raises(SystemExit):
            fm.parse_args(base + extra)
    # the device is checked before any data loads, and "auto" names the one it chose
    assert fm.parse_args(base + ["--device", "auto"]).device == str(
        torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def test_fashion_mnist_bad_counts_are_refused_by_name(idx_tree, tmp_path, capsys):
    """Before, they were accepted: --train-per-class -1 kept all but one image of each class
    (95 of 100, without a word), --quick --train-per-class 0 became 300, --nngk-sigma inf and
    a negative --nngk-sigma-grid failed after the data loaded, --shift -1 in torch."""
    fm = load_script("fashion_mnist")
    base = ["--data-root", idx_tree, "--out", str(tmp_path)]
    for flag, value in (("--train-per-class", "-1"), ("--train-per-class", "0"),
                        ("--eval-per-class", "-2"), ("--batch-size", "0"), ("--dim", "0"),
                        ("--width", "0"), ("--shift", "-1"), ("--nmi-inits", "0"),
                        ("--nngk-k", "0"), ("--nngk-refresh-every", "-1"),
                        ("--nngk-refresh-steps", "0"), ("--nngk-neighbours-every-steps", "0"),
                        ("--nngk-warm-start-steps", "-1"), ("--classify-k", "0"),
                        ("--threads", "0"), ("--nngk-sigma", "inf"),
                        ("--nngk-sigma-grid", "-1")):
        for quick in ([], ["--quick"]):
            with pytest.raises(SystemExit):
                fm.parse_args(base + quick + [flag, value])
            assert flag in capsys.readouterr().err
    # the boundaries are accepted
    args = fm.parse_args(base + ["--shift", "0", "--nngk-refresh-every", "0",
                                 "--train-per-class", "1"])
    assert (args.shift, args.nngk_refresh_every, args.train_per_class) == (0, 0, 1)


def test_fashion_mnist_classification_refuses_methods_without_a_classifier(idx_tree, tmp_path,
                                                                          capsys):
    """Before, --protocol classification --methods contrastive trained the whole run and then
    failed in its evaluation (StopIteration: the loss has no softmax layer)."""
    fm = load_script("fashion_mnist")
    base = ["--data-root", idx_tree, "--out", str(tmp_path / "c"), "--protocol",
            "classification"]
    for method in fm.PML_METHODS:
        with pytest.raises(SystemExit):
            fm.parse_args(base + ["--methods", "nngk", method])
        assert f"--methods {method}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")
    assert fm.parse_args(base).methods == ["nngk", "softmax", "pixels"]


def test_fashion_mnist_refuses_a_cuda_device_the_machine_lacks(idx_tree, tmp_path, monkeypatch,
                                                               capsys):
    fm = load_script("fashion_mnist")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        fm.parse_args(["--data-root", idx_tree, "--out", str(tmp_path), "--device", "cuda"])
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_fashion_mnist_nngk_options_reach_the_trainer(idx_tree, tmp_path):
    fm = load_script("fashion_mnist")
    out = tmp_path / "opts"
    res = fm.main(["--data-root", idx_tree, "--out", str(out), "--quick", "--methods", "nngk",
                   "--seeds", "0", "--tag", "all", "--nngk-fresh-centres", "0.5",
                   "--nngk-neighbours-every-steps", "2", "--nngk-warm-start-steps", "1",
                   "--nngk-sigma", "auto", "--nngk-sigma-grid", "0.1", "0.5", "2.0",
                   "--nngk-learn-sigma", "--nngk-sigma-lr", "0.01"] + FM_TINY)
    run = res["runs"]["nngk-all/s0"]
    opts = run["config"]["nngk"]
    assert (opts["fresh_centres"], opts["neighbours_every_steps"], opts["warm_start_steps"]) == \
        (0.5, 2, 1)
    assert opts["sigma"] == "auto" and opts["sigma_grid"] == [0.1, 0.5, 2.0]
    search = run["sigma_search"]
    assert set(search["loss"]) == {"0.1", "0.5", "2.0"}
    finite = {float(s): v for s, v in search["loss"].items() if v == v}
    assert search["chosen"] == min(finite, key=finite.get)
    hist = run["history"][0]
    # 100 training images / batch 16 (drop_last) = 6 steps: lists rebuilt at steps 2, 4, 6
    # (less any step whose full refresh rebuilt them anyway)
    assert hist["neighbours_rebuilds"] >= 2
    # sigma was learned: it moved from the chosen value
    assert run["metrics"]["final_sigma"] != pytest.approx(float(search["chosen"]), rel=1e-6)
    log = json.load(open(out / "runs" / "nngk-all-s0" / "log.json"))
    assert log[0]["neighbours_rebuilds"] == hist["neighbours_rebuilds"]


def test_fashion_mnist_sigma_sample_is_not_called_held_out(capsys):
    """choose_sigma_for's docstring and --nngk-sigma's help called its 10% sample of the
    training images "held-out", but those images are trained on afterwards (the choice is
    made before training). The wording now says so; the procedure is unchanged."""
    fm = load_script("fashion_mnist")
    with pytest.raises(SystemExit):
        fm.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    doc = " ".join(fm.choose_sigma_for.__doc__.split())
    for text in (help_text, doc):
        sigma_part = text[text.index("choose_sigma"):][:400]
        assert "held-out" not in sigma_part and "held out" not in sigma_part.replace(
            "not held out", "")
    assert "also trained on afterwards" in help_text
    assert "trained on afterwards" in doc and "not held out" in doc


def test_scripts_refuse_seeds_outside_the_range_by_name(capsys):
    """--seed -1 ran as seed 2**32 - 1 (and 2**32 as 0), or failed deep in NumPy (the split
    of classification.py) with an error naming no option."""
    cases = {"digits": (["--out", "x"], "--seed"),
             "metric_learning": (["--dataset", "cub", "--data-root", "x", "--out", "y"],
                                 "--seed"),
             "classification": (["--dataset", "cub", "--data-root", "x", "--out", "y"],
                                "--seed"),
             "fashion_mnist": (["--out", "x", "--data-root", "y"], "--seeds")}
    for name, (argv, opt) in cases.items():
        script = load_script(name)
        for bad in ("-1", str(2 ** 32)):
            with pytest.raises(SystemExit):
                script.parse_args(argv + [opt, bad])
            assert f"argument {opt}: must be an integer in [0, 2**32)" in capsys.readouterr().err
        assert script.parse_args(argv + [opt, str(2 ** 32 - 1)])


@pytest.mark.parametrize("name", ["digits", "metric_learning", "classification", "fashion_mnist"])
def test_help_prints_each_default_once(name, capsys):
    """--epochs' help named its default and argparse appended '(default: None)' after it:
    each option's help now says its default at most once, and never None."""
    with pytest.raises(SystemExit):
        load_script(name).parse_args(["--help"])
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    assert len(options) > 5
    for opt in options:
        assert opt.count("default") <= 1 and "(default: None)" not in opt, opt
    assert "(default: " in text
