"""nnkloss/experiment/logs.py: the Trainer's log.json / log.csv."""
import csv
import json
import math

import numpy as np
import torch

from nnkloss.experiment.logs import LOG_CSV, LOG_JSON, json_safe, write_logs


def test_json_safe_turns_tensors_numpy_and_non_finite_into_json_values():
    assert json_safe(torch.tensor(2.5)) == 2.5 and json_safe(torch.tensor([1, 2])) == [1, 2]
    assert json_safe(np.float32(0.5)) == 0.5 and type(json_safe(np.int64(3))) is int
    assert json_safe(math.nan) is None and json_safe(math.inf) is None
    assert json_safe(torch.tensor(float("nan"))) is None and json_safe("x") == "x"


def test_write_logs_writes_both_files_with_every_column(tmp_path):
    history = [{"epoch": 1, "loss": torch.tensor(0.5)},
               {"epoch": 2, "loss": math.nan, "recall": np.float64(0.25)}]
    write_logs(str(tmp_path), history)
    assert json.loads((tmp_path / LOG_JSON).read_text()) == [
        {"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": None, "recall": 0.25}]
    rows = list(csv.DictReader(open(tmp_path / LOG_CSV)))
    assert list(rows[0]) == ["epoch", "loss", "recall"]
    assert rows[0]["recall"] == "" and rows[1] == {"epoch": "2", "loss": "", "recall": "0.25"}
    write_logs(str(tmp_path), history[:1])  # rewritten whole, not appended
    assert len(json.loads((tmp_path / LOG_JSON).read_text())) == 1
    assert not [p for p in tmp_path.iterdir() if p.name not in (LOG_JSON, LOG_CSV)]


def test_write_logs_removes_temporaries_of_interrupted_writes(tmp_path):
    """A run killed inside write_logs leaves ``.log.json.<8 random>.tmp``: the next write
    (the resumed run, the only writer of its out_dir) removes it; other files stay."""
    torn = [tmp_path / f".{LOG_JSON}.abcd1234.tmp", tmp_path / f".{LOG_CSV}.efgh5678.tmp"]
    other = tmp_path / ".checkpoint.pt.ijkl9012.tmp"
    for f in torn + [other]:
        f.write_bytes(b"torn")
    write_logs(str(tmp_path), [{"epoch": 1, "loss": 0.5}])
    assert not any(f.exists() for f in torn) and other.exists()
    assert json.load(open(tmp_path / LOG_JSON)) == [{"epoch": 1, "loss": 0.5}]
