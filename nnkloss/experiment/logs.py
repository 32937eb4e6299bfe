"""The Trainer's per-epoch log files: ``log.json`` and ``log.csv`` in the run's ``out_dir``.

One row per epoch (a dict); both files are rewritten whole, atomically (temporary file, then
rename), after every epoch, so that an interrupted run leaves the log of its last finished
epoch. Values are made JSON-safe first: tensors and NumPy scalars become Python numbers, and a
non-finite float becomes ``null`` in JSON (an empty cell in CSV).
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import Any, Dict, List, Sequence

import numpy as np
from torch import Tensor

from ..atomic import atomic_write, remove_stale_temps

__all__ = ["LOG_CSV", "LOG_JSON", "json_safe", "write_logs"]

LOG_CSV = "log.csv"
LOG_JSON = "log.json"


def json_safe(v):
    """``v`` as a value ``json.dumps`` writes: a 1-element tensor or a NumPy scalar as a Python
    number, a larger tensor as a list, a non-finite float as None, and so inside lists, tuples
    and dicts (an eval_fn's nested metrics); anything else unchanged."""
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, Tensor):
        v = v.item() if v.numel() == 1 else json_safe(v.tolist())
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_logs(out_dir: str, history: Sequence[Dict[str, Any]]) -> None:
    """(Re)write ``out_dir/log.json`` and ``out_dir/log.csv`` from ``history`` (one dict per
    epoch), atomically. The CSV's columns are every key in order of first appearance; a row
    without a column leaves its cell empty. Temporary files of interrupted writes of the two
    logs are removed first (the run is the only writer of its out_dir, as for its checkpoint)."""
    for name in (LOG_JSON, LOG_CSV):
        remove_stale_temps(os.path.join(out_dir, name))
    rows = [{k: json_safe(v) for k, v in r.items()} for r in history]
    atomic_write(os.path.join(out_dir, LOG_JSON), json.dumps(rows, indent=1).encode("utf-8"))
    cols: List[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    sio = io.StringIO()
    w = csv.DictWriter(sio, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(os.path.join(out_dir, LOG_CSV), sio.getvalue().encode("utf-8"))
