"""nnkloss/experiment/setup.py: the device a script runs on, checked before any work starts."""
import pytest
import torch

from nnkloss.experiment.setup import resolve_device


def test_auto_and_named_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", ""])
def test_a_name_that_is_no_device_names_the_argument(name):
    with pytest.raises(ValueError, match=r"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(name)


def test_a_cuda_device_this_machine_lacks_is_refused_up_front(monkeypatch):
    """Without CUDA, or past the machine's GPUs: RuntimeError naming --device, before any data
    loads (torch's own error came only at the first tensor moved there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"--device cuda: CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match=r"--device cuda:1: this machine has 1 CUDA device"):
        resolve_device("cuda:1")


def test_check_resume_names_a_settings_record_it_cannot_read(tmp_path):
    """A run folder's settings.json is read from disk: one that is not JSON (or not UTF-8, or
    not an object) stops the script naming the file, not with a bare decoding error."""
    import pytest
    from nnkloss.experiment.setup import check_resume
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    for content in (b"{not json", b"\xff\xfe", b"[1, 2]"):
        (tmp_path / "settings.json").write_bytes(content)
        with pytest.raises(SystemExit, match=r"settings.json .*--restart"):
            check_resume(str(tmp_path), {"sigma": 1.0}, restart=False)
    (tmp_path / "settings.json").write_text('{"sigma": 1.0}')
    check_resume(str(tmp_path), {"sigma": 1.0}, restart=False)  # the same settings: resumed


def test_restart_removes_the_old_checkpoint_before_recording_the_new_settings(tmp_path):
    """--restart wrote the new run's settings and left the old checkpoint until the new run's
    first epoch replaced it: a new run stopped before then, and a later invocation without
    --restart found the new settings beside the OLD checkpoint and resumed it as the new run.
    Now the old checkpoint is gone before the new settings are recorded."""
    import json
    from nnkloss.experiment.setup import check_resume
    (tmp_path / "checkpoint.pt").write_bytes(b"the old run")
    (tmp_path / "settings.json").write_text('{"sigma": 1.0}')
    check_resume(str(tmp_path), {"sigma": 2.0}, restart=True)  # the new run stops here
    assert not (tmp_path / "checkpoint.pt").exists()
    assert json.loads((tmp_path / "settings.json").read_text()) == {"sigma": 2.0}
    check_resume(str(tmp_path), {"sigma": 2.0}, restart=False)  # nothing of the old to resume
    assert not (tmp_path / "checkpoint.pt").exists()
    check_resume(str(tmp_path), {"sigma": 3.0}, restart=True)  # none to remove: no error
