"""nnkloss/experiment/reporting.py: the commit that every result of repro/ and benchmarks/ is
labelled with."""
import subprocess

import pytest

from nnkloss.experiment.reporting import RESULTS_DIRS, git_commit


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.parametrize("where", [".", "benchmarks"])
def test_git_commit_is_dirty_for_code_not_for_results(tmp_path, monkeypatch, where):
    """A run that appends rows to a tracked results file leaves the commit clean (the next run
    measures the same code); a change to any other tracked file marks it -dirty; untracked files
    do not count. From the checkout's root or a subdirectory."""
    monkeypatch.delenv("NNKLOSS_COMMIT", raising=False)
    assert RESULTS_DIRS == ("benchmarks/results", "repro/results")
    repo = tmp_path / "repo"
    for name in ("code.py", "benchmarks/results/loss.csv", "repro/results/run/log.txt"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("first\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    cwd = str(repo / where)
    assert git_commit(cwd) == head
    (repo / "benchmarks/results/loss.csv").write_text("first\nrow\n")
    (repo / "repro/results/run/log.txt").write_text("changed\n")
    (repo / "untracked.py").write_text("new\n")
    assert git_commit(cwd) == head
    (repo / "code.py").write_text("changed\n")
    assert git_commit(cwd) == head + "-dirty"
    monkeypatch.setenv("NNKLOSS_COMMIT", "feedbee")  # the device machine's tree has no .git
    assert git_commit(cwd) == "feedbee"


def test_git_commit_outside_a_checkout_is_none(tmp_path, monkeypatch):
    monkeypatch.delenv("NNKLOSS_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert git_commit(str(tmp_path)) is None
