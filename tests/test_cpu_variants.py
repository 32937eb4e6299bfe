"""The CPU kernel's variant A/B (benchmarks/cpu_variants.py): each variant is a verified build
of its own, the op runs on the variant being timed, and a variant that does not build stops
the run naming it."""
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import cpu_variants  # noqa: E402

import nnkloss  # noqa: E402
from nnkloss import cpu  # noqa: E402
from nnkloss.cpu import build as cpu_build  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no compiled CPU kernel here")


# A variant the tests share (each build takes ~25 s): the non-temporal hint, and one pass from
# 1 KB of gathered rows a list, whatever the rows' length (the defaults keep rows shorter than
# 512 bytes, like these of 160, to two passes).
NTA = "NNK_PREFETCH_LOCALITY=0,NNK_ONE_PASS_BYTES=1024,NNK_ONE_PASS_MIN_ROW_BYTES=0"


@pytest.fixture(scope="module")
def built_once():
    """cpu_variants.build with each (defines, source) built once for this module: a build
    takes ~25 s, and the tests below asked for the defaults five times (CI's slowest module).
    Each distinct variant is still a build of its own (the tool itself memoises nothing)."""
    real, libs = cpu_variants.build, {}

    def build(defines, source=None):
        key = (defines, None if source is None else tuple(sorted(source.items())))
        if key not in libs:
            libs[key] = real(defines, source)
        return libs[key]
    return build


@pytest.fixture
def private_tmp(tmp_path, monkeypatch, built_once):
    """Variant caches under tmp_path (the first test to build a variant; loaded, the library
    outlives its files); the process's own library afterwards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_variants, "build", built_once)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)
    cpu_build._reset_for_tests()


def test_variants_are_separate_builds_and_the_op_runs_on_each(private_tmp):
    default = cpu_variants.build("")
    nta = cpu_variants.build(NTA)
    assert default is not nta
    assert os.environ.get("NNKLOSS_CACHE_DIR") != str(private_tmp)  # restored
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(300, 40, generator=g)
    cl = torch.randint(0, 5, (300,), generator=g)
    nb = torch.randint(0, 300, (16, 50), generator=g)
    emb = centres[nb[:, 0]] + 0.1
    labels = cl[nb[:, 0]]
    results = []
    for lib in (default, nta):  # 50 x 40 x 4 bytes > 1024: the second one folds in one pass
        cpu_variants.use(lib)
        assert cpu_build.lib() is lib
        x = emb.clone().requires_grad_(True)
        loss = nnkloss.neighbour_kernel_loss(x, labels, centres, cl, nb, sigma=3.0)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


def test_main_times_every_variant_and_shape_and_writes_the_log(private_tmp):
    log = private_tmp / "ab.txt"
    results = cpu_variants.main(["-D", "", "-D", NTA, "--rounds", "2",
                                 "--iters", "1", "--shapes", "1", "--out", str(log)])
    shape = (1024, 32, 128, "fp32")
    assert set(results) == {("defaults", shape), (NTA, shape)}
    for runs in results.values():
        assert len(runs) == 2 and all(ms > 0 for run in runs for ms in run)
    text = log.read_text().splitlines()
    assert text[0].startswith("# ") and "commit" in text[0] and "threads 2" in text[0]
    assert sum(line.startswith("round ") for line in text) == 4
    assert text.count("# medians over the rounds") == 1
    # Each round's order is rotated: the variant that ran first in round 0 runs last in 1.
    order = [line.split(" | ")[1] for line in text if line.startswith("round ")]
    assert order == ["defaults", NTA, NTA, "defaults"]


def test_in_turn_puts_every_variant_in_every_position_equally_often():
    libs = [("a", 1), ("b", 2), ("c", 3)]
    rounds = [cpu_variants.in_turn(libs, r) for r in range(6)]
    assert rounds[0] == libs and rounds[1] == [("b", 2), ("c", 3), ("a", 1)]
    for pos in range(3):
        firsts = [order[pos][0] for order in rounds]
        assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(order) == libs for order in rounds)


@pytest.mark.filterwarnings("ignore:nnkloss. compiled CPU kernel unavailable:RuntimeWarning")
def test_a_variant_that_does_not_build_stops_the_run_naming_it(private_tmp):
    with pytest.raises(SystemExit, match=r"NNK_PREFETCH_BYTES=\)"):
        cpu_variants.build("NNK_PREFETCH_BYTES=)")  # a syntax error where it is used


def test_against_a_revision_times_the_kernel_calls_of_both(private_tmp):
    """--against REV builds the kernel of that revision beside the variants and times the
    kernel's calls (forward without and with grad_x) on each; the log says so."""
    log = private_tmp / "against.txt"
    results = cpu_variants.main(["-D", "", "--against", "HEAD", "--rounds", "1", "--iters", "1",
                                 "--shapes", "1", "--out", str(log)])
    shape = (1024, 32, 128, "fp32")
    assert set(results) == {("defaults", shape), ("HEAD", shape)}
    assert all(ms > 0 for runs in results.values() for run in runs for ms in run)
    text = log.read_text().splitlines()
    assert text[0].endswith("the kernel's calls, against HEAD")
    rounds = [line for line in text if line.startswith("round ")]
    assert len(rounds) == 2 and all("kernel forward with grad_x" in line for line in rounds)


def test_against_refuses_a_revision_whose_forward_takes_other_parameters():
    """The calls pass today's arguments to both libraries: a kernel whose nnk_forward reads
    another parameter list is refused, naming both; an unknown revision too."""
    with open(cpu_build.SOURCES[0]) as fh:  # op.cpp: nnk_forward and nnk_rel_sqdist
        now = fh.read()
    cpu_variants.check_same_forward("HEAD", now)  # the same: no error
    spaced = now.replace("int nnk_forward(", "int  nnk_forward (", 1)
    cpu_variants.check_same_forward("spaced", spaced)  # whitespace does not count
    other = now.replace("int nnk_forward(int ctype,", "int nnk_forward(int ctype, int extra,", 1)
    assert other != now
    with pytest.raises(SystemExit, match=r"--against old: nnk_forward's parameters differ"):
        cpu_variants.check_same_forward("old", other)
    # the classifier's entry point, for --against with --classifier
    cpu_variants.check_same_forward("HEAD", now, "nnk_rel_sqdist")
    other = now.replace("int nnk_rel_sqdist(int ctype,", "int nnk_rel_sqdist(int ctype, int x,", 1)
    assert other != now
    with pytest.raises(SystemExit, match=r"nnk_rel_sqdist's parameters differ"):
        cpu_variants.check_same_forward("old", other, "nnk_rel_sqdist")
    with pytest.raises(SystemExit, match=r"--against no-such-rev: no library sources there"):
        cpu_variants.source_at("no-such-rev")


def test_classifier_mode_times_rel_sqdist_per_variant_and_compares_the_bits(private_tmp,
                                                                           monkeypatch):
    """--classifier: the classifier's distances on every variant, per round and shape, with a
    line per shape saying whether every variant gave the first one's bits; a variant that
    does not is reported as such. --classifier-shape refuses malformed shapes."""
    log = private_tmp / "cls.txt"
    shapes = [(20, 12, 64, 100), (9, 5, 13, 50)]  # the compile-time D and the run-time D
    argv = ["-D", "", "-D", NTA, "--classifier", "--rounds", "2", "--iters", "1",
            "--classifier-shape", "20,12,64,100", "--classifier-shape", "9,5,13,50"]
    results, same = cpu_variants.main(argv + ["--out", str(log)])
    assert set(results) == {(v, s) for v in ("defaults", NTA) for s in shapes}
    assert all(len(r) == 2 and min(r) > 0 for r in results.values())
    assert same == {s: True for s in shapes}
    text = log.read_text().splitlines()
    assert text[0].endswith("the classifier's distances")
    assert sum(line.startswith("round ") for line in text) == 2 * 2 * 2
    assert "bits | 20,12,64,100 | every variant equal to defaults's: True" in text
    nta = cpu_variants.build(NTA)
    real = cpu.rel_sqdist

    def off_by_one_ulp_on_nta(*a):
        out = real(*a)
        return torch.nextafter(out, out + 1) if cpu_build.lib() is nta else out
    monkeypatch.setattr(cpu, "rel_sqdist", off_by_one_ulp_on_nta)
    _, same = cpu_variants.main(argv)
    assert same == {s: False for s in shapes}
    for bad in ("20,12,64", "20,12,0,100", "a,12,64,100"):
        with pytest.raises(Exception, match="--classifier-shape"):
            cpu_variants.parse_classifier_shape(bad)


def test_shape_option_measures_a_shape_of_its_own_and_refuses_bad_ones(private_tmp):
    """--shape B,K,D,N,DTYPE adds a shape outside bench_loss's grid; given alone, only it is
    measured. A malformed one is refused naming the option."""
    assert cpu_variants.parse_shape("8,3,20,50,bf16") == (8, 3, 20, 50, "bf16")
    for bad in ("8,3,20,50", "8,3,20,50,int8", "8,x,20,50,fp32", "0,3,20,50,fp32"):
        with pytest.raises(Exception, match="--shape"):
            cpu_variants.parse_shape(bad)
    with pytest.raises(SystemExit):  # argparse reports the bad value and exits
        cpu_variants.main(["-D", "", "--shape", "8,3,20"])
    results = cpu_variants.main(["-D", "", "--rounds", "1", "--iters", "1",
                                 "--shape", "8,3,20,50,fp32"])
    assert set(results) == {("defaults", (8, 3, 20, "fp32"))}


def test_fixed_row_bytes_knob_gives_the_same_bits(private_tmp):
    """fp32 / bf16 rows of D 64, 128, 256 read one at a time (row_distances_fixed, every one of
    them with NNK_FIXED_ROW_BYTES=1024) or in groups of four (=0): the distances, losses and
    gradients keep their bits."""
    fixed = cpu_variants.build("NNK_FIXED_ROW_BYTES=1024")
    groups = cpu_variants.build("NNK_FIXED_ROW_BYTES=0")
    g = torch.Generator().manual_seed(3)
    for D, dtype in ((64, torch.float32), (128, torch.bfloat16), (256, torch.float32)):
        centres = torch.randn(500, D, generator=g).to(dtype)
        cl = torch.randint(0, 7, (500,), generator=g)
        nb = torch.randint(0, 500, (21, 13), generator=g)  # K 13: groups of four and a rest
        emb = centres[nb[:, 0]].float() + 0.1 * torch.randn(21, D, generator=g)
        outs = []
        for lib in (fixed, groups):
            cpu_variants.use(lib)
            outs.append(cpu.forward(emb, cl[nb[:, 0]], centres, cl, nb, None, 2.0))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (D, dtype)


def test_variant_items_are_macros_added_options_or_removed_options():
    base = ["-O3", "-fno-trapping-math", "-shared"]
    assert cpu_variants.variant_flags("", base) == base
    assert cpu_variants.variant_flags("A=1, -fno-tree-vectorize,!-fno-trapping-math", base) == [
        "-O3", "-shared", "-DA=1", "-fno-tree-vectorize"]
    with pytest.raises(SystemExit, match=r"\['-ffast-math'\] not among the compiler options"):
        cpu_variants.variant_flags("!-ffast-math", base)
    assert "-fno-trapping-math" in cpu_build.FLAGS  # the kernel's exponentials vectorise on AVX2


def test_gather_option_times_the_limit_and_gives_each_variant_as_a_share_of_it(private_tmp):
    """--kernel --gather: the kernel's calls and, per round and shape, the gather limit; the
    medians give each variant's times as % of it."""
    log = private_tmp / "gather.txt"
    results = cpu_variants.main(["-D", "", "--kernel", "--gather", "--rounds", "2", "--iters",
                                 "1", "--shape", "16,8,64,300,fp32", "--out", str(log)])
    shape = (16, 8, 64, "fp32")
    assert set(results) == {("defaults", shape), (cpu_variants.GATHER, shape)}
    text = log.read_text().splitlines()
    assert text[0].endswith("the kernel's calls | with the gather limit")
    assert sum(line.startswith("round ") and "gather limit" in line for line in text) == 2
    (last,) = [line for line in text if line.startswith("defaults |") and "%" in line]
    assert "kernel forward with grad_x" in last and "of the gather limit" in last
