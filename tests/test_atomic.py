"""nnkloss/atomic.py: the one atomic file writer (banks, checkpoints, logs, results): a hidden
temporary file beside the target, renamed over it; errors name the path; the target's mode kept.
"""
import pytest

import nnkloss
from cases import small_bank


# -----------------------------------------------------------------------------------------------
# Moved from tests/test_mutation_kills.py (issue 14 mutation runs, tests/MUTATION.md; issue 19).
def test_save_into_a_missing_directory_names_path(tmp_path):
    """kills atomic.atomic_write 1 (the default argument name in the error)."""
    bank = small_bank()
    with pytest.raises(FileNotFoundError, match=r"^path '.*nodir.*': directory .* does not exist"):
        nnkloss.save_bank(bank, tmp_path / "nodir" / "bank.pt")


def test_atomic_write_stages_a_hidden_tmp_file_beside_the_target(tmp_path):
    """While the data is written, the only new entry of the target's directory is a hidden
    ``.NAME.*.tmp`` file (never a partial NAME, nor a file a ``*.pt`` glob would pick up); it is
    in the same directory, so the final rename never crosses a file system. Kills
    atomic.atomic_write 12, 13, 14."""
    from nnkloss.atomic import atomic_write

    seen = []

    def write(f):
        seen.extend(sorted(p.name for p in tmp_path.iterdir()))
        f.write(b"new")

    (tmp_path / "a.pt").write_bytes(b"old")
    atomic_write(tmp_path / "a.pt", write)
    assert len(seen) == 2 and seen[1] == "a.pt", seen
    assert seen[0].startswith(".a.pt.") and seen[0].endswith(".tmp"), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]
    assert (tmp_path / "a.pt").read_bytes() == b"new"


def test_atomic_write_of_bytes_keeps_the_target_mode(tmp_path):
    """bytes data, and an existing target's permissions kept (kills atomic.atomic_write 22, 24,
    39)."""
    import os
    from nnkloss.atomic import atomic_write

    target = tmp_path / "log.json"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    assert atomic_write(target, b"{}\n") == os.fspath(target)
    assert target.read_bytes() == b"{}\n"
    assert os.stat(target).st_mode & 0o7777 == 0o600


def test_atomic_write_gives_a_new_file_0644_less_the_umask(tmp_path):
    """A new file gets 0644 less the umask (audit A): a fixed 0644 made a checkpoint written
    under umask 077 readable by every user. Never group-writable (umask 002): cpu.py refuses
    a sha256 record that is."""
    import os
    from nnkloss.atomic import _umask, atomic_write

    old = os.umask(0o077)
    try:
        assert _umask() == 0o077
        atomic_write(tmp_path / "private.pt", b"x")
        os.umask(0o022)
        atomic_write(tmp_path / "usual.pt", b"x")
        os.umask(0o002)
        atomic_write(tmp_path / "group.pt", b"x")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "private.pt").st_mode & 0o7777 == 0o600
    assert os.stat(tmp_path / "usual.pt").st_mode & 0o7777 == 0o644
    assert os.stat(tmp_path / "group.pt").st_mode & 0o7777 == 0o644


def test_remove_stale_temps_removes_only_names_mkstemp_gives(tmp_path):
    """Only ``.NAME.<8 of mkstemp's characters>.tmp`` beside NAME goes; other names stay."""
    from nnkloss.atomic import remove_stale_temps
    gone = tmp_path / ".a.pt.ab_d1234.tmp"
    kept = [tmp_path / n for n in (".a.pt.abcd123.tmp", ".a.pt.abcd12345.tmp",
                                   ".a.pt.ABCD1234.tmp", ".a.pt.abcd1234.tmpx",
                                   ".b.pt.abcd1234.tmp", "a.pt.abcd1234.tmp")]
    for f in [gone] + kept:
        f.write_bytes(b"x")
    assert remove_stale_temps(tmp_path / "a.pt") == [str(gone)]
    assert all(f.exists() for f in kept)
