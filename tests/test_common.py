"""benchmarks/common.py: the commit a figure is labelled with (the rule itself:
tests/test_reporting.py)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common  # noqa: E402


def test_git_commit_reads_the_override(monkeypatch):
    """benchmarks/gpu_session.sh passes the commit in: the device machine's tree has no .git."""
    monkeypatch.setenv("NNKLOSS_COMMIT", "feedbee")
    assert common.git_commit() == "feedbee"
    monkeypatch.delenv("NNKLOSS_COMMIT")
    assert common.git_commit() != "feedbee"


def test_git_commit_outside_a_checkout_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("NNKLOSS_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert common.git_commit(str(tmp_path)) == "unknown"
