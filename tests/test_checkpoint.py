"""save_bank / load_bank: round trip, resuming gives the same loss, atomic writes."""
import contextlib
import os
import signal

import pytest
import torch

import nnkloss
import nnkloss.bank.checkpoint as ckpt
from nnkloss import CentreBank, RefreshSchedule, load_bank, save_bank


def make_bank(learn_weights=True, seed=0, n=60, d=8, k=6):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n, d, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    weights = torch.rand(n, generator=g) + 0.5 if learn_weights else None
    bank = CentreBank(centres, labels, weights=weights, learn_weights=learn_weights)
    bank.rebuild_neighbours(k, search_backend="torch", ensure_positive=True)
    return bank


def batch_loss(bank, sigma=1.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(bank.num_centres, generator=g)[:16]
    emb = bank.centres[idx] + 0.1 * torch.randn(16, bank.dim, generator=g)
    return nnkloss.NeighbourKernelLoss(bank, sigma=sigma)(emb, bank.centre_labels[idx], idx)


@pytest.mark.parametrize("learn_weights", [True, False])
def test_round_trip_and_same_loss(tmp_path, learn_weights):
    bank = make_bank(learn_weights)
    with torch.no_grad():
        before = batch_loss(bank)
    sched = RefreshSchedule(every_epochs=5)
    sched.epoch_end()
    path = tmp_path / "bank.pt"
    save_bank(bank, path, step=123, extra={"sigma": 1.3, "schedule": sched.state_dict(),
                                           "note": "epoch 1", "t": torch.arange(3)})
    loaded, step, extra = load_bank(path)
    assert step == 123 and extra["sigma"] == 1.3 and extra["note"] == "epoch 1"
    assert torch.equal(extra["t"], torch.arange(3))
    for name in ("centres", "centre_labels", "neighbours", "log_weights"):
        assert torch.equal(getattr(loaded, name), getattr(bank, name)), name
    assert loaded.learn_weights == learn_weights
    assert (loaded.weights_for_loss() is None) == (not learn_weights)
    with torch.no_grad():
        after = batch_loss(loaded)
    assert torch.equal(after, before)
    resumed = RefreshSchedule(every_epochs=5)
    resumed.load_state_dict(extra["schedule"])
    assert resumed.epoch == 1
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_map_location_and_dtype(tmp_path):
    bank = CentreBank(torch.randn(10, 4).to(torch.bfloat16), torch.arange(10) % 2)
    bank.rebuild_neighbours(3, search_backend="torch")
    save_bank(bank, tmp_path / "b.pt")
    loaded, step, extra = load_bank(tmp_path / "b.pt", map_location="cpu")
    assert loaded.centres.dtype == torch.bfloat16 and step == 0 and extra is None
    assert torch.equal(loaded.centres, bank.centres)


def test_failed_write_leaves_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "bank.pt"
    old_bank = make_bank(seed=0)
    save_bank(old_bank, path, step=1)
    old_bytes = path.read_bytes()

    real_save = torch.save

    def half_then_fail(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        f.truncate(100)  # a torn write ...
        raise OSError("No space left on device")  # ... then the error

    monkeypatch.setattr(ckpt.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_bank(make_bank(seed=5), path, step=2)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["bank.pt"]  # no temp file left behind
    loaded, step, _ = load_bank(path)
    assert step == 1 and torch.equal(loaded.centres, old_bank.centres)


def test_bad_arguments(tmp_path):
    bank = make_bank()
    with pytest.raises(TypeError, match=r"extra\['f'\] is a function"):
        save_bank(bank, tmp_path / "x.pt", extra={"f": lambda: 0})
    with pytest.raises(TypeError, match="extra must be a dict"):
        save_bank(bank, tmp_path / "x.pt", extra=[1])
    with pytest.raises(ValueError, match="step"):
        save_bank(bank, tmp_path / "x.pt", step=-1)
    with pytest.raises(TypeError, match="bank"):
        save_bank(torch.zeros(3), tmp_path / "x.pt")
    assert not os.listdir(tmp_path)
    torch.save({"something": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an nnkloss CentreBank checkpoint"):
        load_bank(tmp_path / "other.pt")


class Evil:
    pass


def test_load_is_weights_only(tmp_path):
    """A file holding an arbitrary pickled object is refused (no code runs at load), even with
    a valid checksum (anyone who can write the file can compute one)."""
    from nnkloss.checksum import save_checked
    save_checked({"format": "nnkloss.CentreBank", "obj": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="[Ww]eights only|weights_only|Unsupported"):
        load_bank(tmp_path / "evil.pt")
    torch.save({"format": "nnkloss.CentreBank", "obj": Evil()}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="[Ww]eights only|weights_only|Unsupported"):
        load_bank(tmp_path / "old.pt", allow_unchecked=True)


def test_a_flipped_bit_anywhere_is_refused_naming_the_file(tmp_path):
    """The payload's sha256 is checked before anything is unpickled: one flipped bit, in the
    header or the payload (torch does not check its zip CRCs), is an error naming the file."""
    path = tmp_path / "bank.pt"
    save_bank(make_bank(), path, step=3)
    good = path.read_bytes()
    g = torch.Generator().manual_seed(0)
    positions = [0, 20, 40, len(good) // 2, len(good) - 1]
    positions += torch.randint(0, len(good), (40,), generator=g).tolist()
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << int(torch.randint(0, 8, (), generator=g))
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=f"{path}"):
            load_bank(path)
    for cut in (10, 80, len(good) // 3, len(good) - 1):
        path.write_bytes(good[:cut])
        want = "no checksum" if cut < 15 else "does not match its sha256"
        with pytest.raises(ValueError, match=want):
            load_bank(path)
    path.write_bytes(good)
    assert load_bank(path)[1] == 3


def _rezipped(payload: bytes, deflate: bool) -> bytes:
    """torch.save's zip archive ``payload`` with its records rewritten, compressed or not."""
    import io
    import zipfile
    src = zipfile.ZipFile(io.BytesIO(payload))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            new.compress_type = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            dst.writestr(new, src.read(info.filename))
    return out.getvalue()


def _with_checksum(payload: bytes) -> bytes:
    import hashlib
    from nnkloss.checksum import MAGIC
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def test_a_record_that_inflates_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    """torch.save stores its records uncompressed; torch.load would inflate a compressed one
    to what the archive declares (a zip bomb: 4 MiB of centres from a file of a few KB here,
    gigabytes from a few MB). Such a file, even behind a valid checksum, is refused naming the
    file before torch.load runs; so is an archive whose records declare more bytes than it
    holds. The same archive stored uncompressed loads."""
    import io
    bank = CentreBank(torch.zeros(1 << 17, 8), torch.zeros(1 << 17, dtype=torch.long))
    path = tmp_path / "bank.pt"
    save_bank(bank, path)
    payload = path.read_bytes()[len(nnkloss.checksum.MAGIC) + 65:]
    deflated = _rezipped(payload, deflate=True)
    assert len(deflated) < len(payload) // 50
    stored = _rezipped(payload, deflate=False)
    # the central directory entry of the largest record declares 64 GiB (its size fields:
    # compressed at offset 20, uncompressed at 24 of the entry)
    import struct
    import zipfile
    archive = zipfile.ZipFile(io.BytesIO(stored))
    big = max(archive.infolist(), key=lambda i: i.file_size)
    at = archive.start_dir  # the central directory's first entry
    while stored[at + 46:at + 46 + struct.unpack_from("<H", stored, at + 28)[0]] \
            != big.filename.encode():
        at = stored.index(b"PK\x01\x02", at + 4)
    declared = bytearray(stored)
    struct.pack_into("<I", declared, at + 24, 0xFFFFFFF0)
    real_load = torch.load
    for data, match in ((deflated, r"record '[^']+' is compressed \(to inflate to \d+ bytes\)"),
                        (bytes(declared), r"records declare \d+ bytes, more than the file's")):
        path.write_bytes(_with_checksum(data))

        def not_reached(*a, **k):
            raise AssertionError("torch.load reached")
        monkeypatch.setattr(torch, "load", not_reached)
        with pytest.raises(ValueError, match=match) as e:
            load_bank(path)
        assert str(path) in str(e.value) and "CentreBank checkpoint" in str(e.value)
        monkeypatch.setattr(torch, "load", real_load)
    path.write_bytes(_with_checksum(stored))
    assert load_bank(path)[0].num_centres == 1 << 17


@contextlib.contextmanager
def _within(seconds: float):
    """TimeoutError if the block runs longer than ``seconds`` (SIGALRM: the main thread)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_a_view_larger_than_its_storage_is_refused(tmp_path):
    """A file can describe a view with a stride of 0 over one stored value: 16.7M centres from
    a file of a few KB, whose first copy would allocate them all. load_checked refuses any
    tensor whose elements do not all have bytes in its storage, and any tensor that is not
    strided (a sparse one densifies the same way), or that holds no values (the meta device:
    load_bank raised RuntimeError "Tensor.item() cannot be called on meta tensors", naming
    nothing); save_checked refuses to write one."""
    import io
    from nnkloss.checksum import load_checked, save_checked
    path = tmp_path / "bank.pt"
    save_bank(make_bank(), path)
    state = load_checked(path)
    n = 1 << 24
    for key, value, match in (
            ("centres", torch.zeros(1, 8).expand(n, 8),
             r"\['centres'\] of shape \(16777216, 8\) and strides \(0, 1\) covers 536870912 "
             r"bytes, its storage holds 32"),
            ("log_weights", torch.zeros(5).as_strided((3, 3), (1, 1)),  # overlapping rows
             r"\['log_weights'\] .* covers 36 bytes, its storage holds 20"),
            ("centres", torch.zeros(60, 8).to_sparse(),
             r"\['centres'\] is a torch.sparse_coo tensor"),
            ("centres", torch.empty(n, 8, device="meta"),   # a file of 1.7 KB
             r"\['centres'\] is a tensor on the meta device, which holds no values")):
        evil = dict(state, **{key: value})
        buf = io.BytesIO()
        torch.save(evil, buf)
        path.write_bytes(_with_checksum(buf.getvalue()))
        assert path.stat().st_size < 1 << 16
        with pytest.raises(ValueError, match=f"{path}.*cannot be read safely: {match}"):
            load_bank(path)
        with pytest.raises(ValueError, match=f"cannot be saved .*: {match}"):
            save_checked(evil, tmp_path / "other.pt")
        assert not (tmp_path / "other.pt").exists()
    with pytest.raises(ValueError, match=r"cannot be saved .*\['extra'\]\['mask'\]"):
        save_bank(make_bank(), tmp_path / "b.pt", extra={"mask": torch.ones(1).expand(5)})
    # a list that holds itself, and one list shared 2^40 times over (40 levels of pairs), are
    # data a pickle can describe: checked once each, no endless walk
    loop = []
    loop.append(loop)
    shared = [torch.zeros(2)]
    for _ in range(40):
        shared = [shared, shared]
    with _within(20):  # a walk that forgot where it had been would never end: fail, not hang
        save_bank(make_bank(), tmp_path / "b.pt", extra={"loop": loop, "shared": shared})
        got = load_bank(tmp_path / "b.pt")[2]
    assert got["loop"][0] is got["loop"] and got["shared"][0] is got["shared"][1]
    # views that own their bytes are fine: a slice, a transpose, a 0-element tensor
    extra = {"slice": torch.arange(10.0)[2:5], "t": torch.ones(3, 2).t(),
             "empty": torch.zeros(1).expand(0)}
    save_bank(make_bank(), tmp_path / "b.pt", extra=extra)
    got = load_bank(tmp_path / "b.pt")[2]
    assert all(torch.equal(got[k], v) for k, v in extra.items())


def test_file_without_checksum_is_read_only_when_asked(tmp_path):
    """A checkpoint written before checksums: refused by default, read (weights-only and
    validated) with allow_unchecked=True."""
    bank = make_bank()
    from nnkloss.checksum import load_checked
    save_bank(bank, tmp_path / "new.pt", step=4)
    torch.save(load_checked(tmp_path / "new.pt"), tmp_path / "old.pt")
    with pytest.raises(ValueError, match="no checksum.*allow_unchecked=True"):
        load_bank(tmp_path / "old.pt")
    loaded, step, _ = load_bank(tmp_path / "old.pt", allow_unchecked=True)
    assert step == 4 and torch.equal(loaded.centres, bank.centres)


@pytest.mark.parametrize("content", [b"junk", b"", b"\x80\x02 a legacy pickle", b"nnkloss-sha25"])
def test_a_file_that_is_no_archive_is_not_offered_the_unchecked_read(tmp_path, content):
    """allow_unchecked=True is suggested only for a torch.save archive without a checksum
    (what nnkloss wrote before checksums), never for a file that is none: it was suggested for
    any file without the header, junk included."""
    (tmp_path / "junk.pt").write_bytes(content)
    with pytest.raises(ValueError, match="not a torch.save archive") as info:
        load_bank(tmp_path / "junk.pt")
    assert "allow_unchecked" not in str(info.value)
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_bank(tmp_path / "junk.pt", allow_unchecked=True)


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
from cases import small_bank  # noqa: E402
from nnkloss.checksum import load_checked, save_checked  # noqa: E402


def test_save_bank_refuses_unloadable_values_inside_lists(tmp_path):
    """extra is checked all the way down lists and tuples, and the error says where (kills
    mutants of save_bank's extra check)."""
    with pytest.raises(TypeError, match=r"^extra\['runs'\]\[1\]\[0\] is a function"):
        nnkloss.save_bank(small_bank(), tmp_path / "b.pt",
                          extra={"runs": [1, (lambda: 0, 2)], "ok": (1.5, "x", None)})
    nnkloss.save_bank(small_bank(), tmp_path / "b.pt", extra={"ok": [1.5, ("x", None, True)]})
    assert nnkloss.load_bank(tmp_path / "b.pt")[2] == {"ok": [1.5, ("x", None, True)]}


def test_extra_errors_say_what_a_checkpoint_holds(tmp_path):
    """Kills mutants of save_bank's extra check: the key error text and the list of what a
    checkpoint may hold."""
    with pytest.raises(TypeError, match=r"^extra\['d'\] has a key of type tuple; use str or int$"):
        nnkloss.save_bank(small_bank(), tmp_path / "b.pt", extra={"d": {(1, 2): 0}})
    with pytest.raises(TypeError, match=r"is a set; checkpoints hold only tensors, numbers, "
                                        r"strings, None and lists/tuples/dicts of them$"):
        nnkloss.save_bank(small_bank(), tmp_path / "b.pt", extra={"s": {1}})


def test_load_is_weights_only_whatever_torch_defaults_to(tmp_path, monkeypatch):
    """weights_only=True is passed explicitly: still refused where torch's own default is
    weights_only=False (torch < 2.6, which setup.py allows, or this variable). Kills
    checkpoint.load_bank 9, 12."""
    save_checked({"format": "nnkloss.CentreBank", "obj": Evil()}, tmp_path / "evil.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        nnkloss.load_bank(tmp_path / "evil.pt")


def test_load_bank_honours_map_location_and_refuses_newer_versions(tmp_path):
    """map_location is handed to torch.load (a function is called per storage); a newer format
    version is refused; a corrupt file's error names the underlying exception. Kills
    checkpoint.load_bank 8, 11, 15, 24."""
    path = tmp_path / "b.pt"
    nnkloss.save_bank(small_bank(), path)
    seen = []
    bank, step, _ = nnkloss.load_bank(path, map_location=lambda s, loc: seen.append(loc) or s)
    assert seen and set(seen) == {"cpu"} and bank.num_centres == 12
    state = load_checked(path)
    state["version"] = 3
    save_checked(state, tmp_path / "new.pt")
    with pytest.raises(ValueError, match="checkpoint version 3 is newer than this nnkloss reads"):
        nnkloss.load_bank(tmp_path / "new.pt")
    # Since issue 18 a torn file fails its checksum; junk behind a valid checksum still gets
    # torch's own error, named.
    import hashlib
    from nnkloss.checksum import MAGIC
    junk = b"PK not a zip at all"
    (tmp_path / "torn.pt").write_bytes(MAGIC + hashlib.sha256(junk).hexdigest().encode() + b"\n"
                                       + junk)
    with pytest.raises(ValueError, match=r"CentreBank checkpoint\) cannot be read safely "
                                         r"\(UnpicklingError: Weights only load failed"):
        nnkloss.load_bank(tmp_path / "torn.pt")


def test_load_bank_reads_old_files_and_names_bad_log_weights(tmp_path):
    """A file without a version (older writer) loads; a bad log_weights entry is named as the
    checkpoint's. Kills checkpoint.load_bank 25, 27, 52-54, 62, 66."""
    path = tmp_path / "b.pt"
    nnkloss.save_bank(small_bank(), path)
    state = load_checked(path)
    old = dict(state)
    del old["version"]
    save_checked(old, tmp_path / "old.pt")
    assert nnkloss.load_bank(tmp_path / "old.pt")[0].num_centres == 12
    for value, exc, match in (([0.0] * 12, TypeError,
                               r"^checkpoint log_weights must be a torch.Tensor, got list$"),
                              (torch.full((12,), float("nan")), ValueError,
                               r"^checkpoint log_weights contain NaN")):
        bad = dict(state, log_weights=value)
        save_checked(bad, tmp_path / "bad.pt")
        with pytest.raises(exc, match=match):
            nnkloss.load_bank(tmp_path / "bad.pt")


def test_save_bank_argument_errors_and_version_field(tmp_path):
    """bool / float steps refused, wrong types named, the file records its format version (kills
    checkpoint.save_bank 4, 6, 15, 20, 21)."""
    bank, path = small_bank(), tmp_path / "b.pt"
    for step in (True, 1.5):
        with pytest.raises(ValueError, match=rf"^step must be a non-negative int, got {step!r}$"):
            nnkloss.save_bank(bank, path, step=step)
    with pytest.raises(TypeError, match=r"^bank must be a CentreBank, got Tensor$"):
        nnkloss.save_bank(torch.zeros(3), path)
    with pytest.raises(TypeError, match=r"^extra must be a dict or None, got list$"):
        nnkloss.save_bank(bank, path, extra=[1])
    nnkloss.save_bank(bank, path, step=7)
    state = load_checked(path)
    assert state["format"] == "nnkloss.CentreBank" and state["version"] == 2
    assert nnkloss.load_bank(path)[1] == 7


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_promises_bank.py (issue 14 README promises; issue 19).
from cases import nonuniform, random_bank  # noqa: E402


def test_save_load_bank_keeps_fixed_nonuniform_weights(tmp_path):
    bank = random_bank(weights=nonuniform(30, seed=4))
    nnkloss.save_bank(bank, tmp_path / "bank.pt")
    loaded, _, _ = nnkloss.load_bank(tmp_path / "bank.pt")
    assert not loaded.learn_weights
    torch.testing.assert_close(loaded.weights_for_loss(), bank.weights_for_loss())
def _as_version_1(state):
    """A bank file's payload as nnkloss wrote it before issue 19 (format version 1): the centre
    labels under the key "labels"."""
    old = {k: v for k, v in state.items() if k != "centre_labels"}
    old["labels"] = state["centre_labels"]
    old["version"] = 1
    return old


def test_version_2_file_names_the_centre_labels(tmp_path):
    from nnkloss.checksum import load_checked
    bank = make_bank()
    save_bank(bank, tmp_path / "b.pt")
    state = load_checked(tmp_path / "b.pt")
    assert state["version"] == 2 and "labels" not in state
    assert torch.equal(state["centre_labels"], bank.centre_labels)


def test_version_1_file_is_read_under_the_new_name_and_still_validated(tmp_path):
    """Version 1 differs only in the key of the centre labels: it is loaded, converted, and
    validated like any other file (a bad "labels" entry is refused as centre_labels)."""
    from nnkloss.checksum import load_checked, save_checked
    bank = make_bank()
    save_bank(bank, tmp_path / "new.pt", step=5)
    old = _as_version_1(load_checked(tmp_path / "new.pt"))
    save_checked(old, tmp_path / "v1.pt")
    loaded, step, _ = load_bank(tmp_path / "v1.pt")
    assert step == 5
    for name in ("centres", "centre_labels", "neighbours", "log_weights"):
        assert torch.equal(getattr(loaded, name), getattr(bank, name)), name
    with torch.no_grad():
        assert torch.equal(batch_loss(loaded), batch_loss(bank))
    save_checked(dict(old, labels=old["labels"][:-1]), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"^checkpoint centre_labels has length 59 but there "
                                         r"are 60 centres$"):
        load_bank(tmp_path / "bad.pt")
    # A version-2 file must hold the new key: "labels" alone is not read there.
    save_checked(dict(old, version=2), tmp_path / "v2_old_key.pt")
    with pytest.raises(ValueError, match=r"lacks centre_labels"):
        load_bank(tmp_path / "v2_old_key.pt")
    save_checked(dict(old, version="1"), tmp_path / "str_version.pt")
    with pytest.raises(ValueError, match=r"^checkpoint version must be an int, got '1'$"):
        load_bank(tmp_path / "str_version.pt")


def test_state_dict_of_version_1_is_read_under_the_new_name():
    """PyTorch's per-module state-dict version: CentreBank's is 2 ("centre_labels"); a state
    dict of version 1 (or one without version metadata) holding "labels" loads as before,
    directly and through a loss (prefix "bank.")."""
    bank = make_bank()
    state = bank.state_dict()
    assert "centre_labels" in state and "labels" not in state
    assert state._metadata[""]["version"] == 2
    old = {("labels" if k == "centre_labels" else k): v.clone() for k, v in state.items()}
    target = make_bank(seed=3)
    target.load_state_dict(old)              # a plain dict: no version metadata
    assert torch.equal(target.centre_labels, bank.centre_labels)
    assert torch.equal(target.centres, bank.centres)

    src = nnkloss.NeighbourKernelLoss(bank, sigma=1.3)
    sd = src.state_dict()
    old = type(sd)((("bank.labels" if k == "bank.centre_labels" else k), v) for k, v in sd.items())
    old._metadata = type(sd._metadata)(sd._metadata)
    old._metadata["bank"] = dict(sd._metadata["bank"], version=1)
    dst = nnkloss.NeighbourKernelLoss(make_bank(seed=4), sigma=1.0)
    dst.load_state_dict(old)
    assert torch.equal(dst.bank.centre_labels, bank.centre_labels)
    # Version 2 means the new key: an old key there is an unexpected key, as PyTorch reports.
    old._metadata["bank"] = dict(sd._metadata["bank"], version=2)
    with pytest.raises(RuntimeError, match=r'(?s)Missing key\(s\).*"bank\.centre_labels".*'
                                           r'Unexpected key\(s\).*"bank\.labels"'):
        nnkloss.NeighbourKernelLoss(make_bank(seed=4)).load_state_dict(old)


def test_bank_file_is_the_bank_state_dict_and_loads_through_load_state_dict(tmp_path,
                                                                           monkeypatch):
    """Issue 19: one bank persistence. save_bank writes the bank's state_dict (and whether the
    weights are learned), load_bank restores it through CentreBank.load_state_dict."""
    bank = make_bank(learn_weights=True)
    nnkloss.save_bank(bank, tmp_path / "b.pt", step=7)
    state = load_checked(tmp_path / "b.pt")
    sd = bank.state_dict()
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert tensors == set(sd)
    assert all(torch.equal(state[k], sd[k].cpu()) for k in sd)
    calls = []
    real = nnkloss.CentreBank.load_state_dict
    monkeypatch.setattr(nnkloss.CentreBank, "load_state_dict",
                        lambda self, d, *a, **k: (calls.append(sorted(d)), real(self, d, *a, **k))[1])
    loaded, step, _ = nnkloss.load_bank(tmp_path / "b.pt")
    assert calls == [sorted(sd)] and step == 7 and loaded.learn_weights
    assert torch.equal(loaded.log_weights, bank.log_weights.detach())
    # A file of the previous writer (with its "uniform_weights" flag) still loads.
    nnkloss.save_bank(make_bank(learn_weights=False), tmp_path / "u.pt")
    old = dict(load_checked(tmp_path / "u.pt"), uniform_weights=True)
    save_checked(old, tmp_path / "old.pt")
    assert nnkloss.load_bank(tmp_path / "old.pt")[0].weights_for_loss() is None


def test_save_bank_removes_stale_temporaries_and_keeps_fresh_ones(tmp_path):
    """A killed save_bank leaves ``.<name>.<8 random>.tmp`` beside the file: the next save
    removes it once it is STALE_TEMP_SECONDS old, and keeps a fresh one (another writer's)."""
    from nnkloss.bank import checkpoint
    path = tmp_path / "bank.pt"
    stale, fresh = tmp_path / ".bank.pt.abcd1234.tmp", tmp_path / ".bank.pt.efgh5678.tmp"
    for f in (stale, fresh):
        f.write_bytes(b"torn")
    old = os.path.getmtime(stale) - checkpoint.STALE_TEMP_SECONDS - 10
    os.utime(stale, (old, old))
    nnkloss.save_bank(make_bank(), path)
    assert not stale.exists() and fresh.exists()
    assert nnkloss.load_bank(path)[0].num_centres == 60


def test_load_bank_refuses_log_weights_whose_weight_overflows(tmp_path):
    """A log-weight of 1000 (finite) is a weight of inf: refused on load (audit A)."""
    from nnkloss.checksum import load_checked, save_checked
    path = tmp_path / "b.pt"
    save_bank(nnkloss.CentreBank(torch.randn(4, 3), torch.arange(4) % 2), path)
    state = load_checked(path)
    state["log_weights"] = torch.full((4,), 1000.0)
    save_checked(state, path)
    with pytest.raises(ValueError, match=r"log_weights hold a value whose weight"):
        load_bank(path)


def test_load_bank_refuses_a_learn_weights_or_extra_of_another_type(tmp_path):
    """learn_weights is read as save_bank writes it, a bool (audit A): the string "False" loaded
    a bank with learned weights, a tensor of two values failed with torch's "Boolean value of
    Tensor" error; an extra that is not a dict (or None) was returned as it was."""
    from nnkloss.checksum import load_checked, save_checked
    path = tmp_path / "b.pt"
    save_bank(nnkloss.CentreBank(torch.randn(4, 3), torch.arange(4) % 2), path)
    good = load_checked(path)
    for field, value, kind in (("learn_weights", "False", "str"),
                               ("learn_weights", torch.tensor([True, False]), "Tensor"),
                               ("learn_weights", None, "NoneType"),
                               ("extra", [1, 2], "list")):
        save_checked({**good, field: value}, path)
        with pytest.raises(ValueError, match=rf"^checkpoint {field} must be a .*got {kind}$"):
            load_bank(path)
    save_checked({**good, "learn_weights": True, "extra": {"sigma": 2.0}}, path)
    bank, _, extra = load_bank(path)
    assert bank.learn_weights and extra == {"sigma": 2.0}
