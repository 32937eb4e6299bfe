"""The Trainer's log files, ``log.json`` and ``log.csv``: one row per epoch, rewritten whole."""
from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import Any, Dict, Sequence

import numpy as np
from torch import Tensor

from ..atomic import atomic_write, remove_stale_temps

__all__ = ["LOG_CSV", "LOG_JSON", "json_safe", "write_logs"]

LOG_CSV = "log.csv"
LOG_JSON = "log.json"


def json_safe(v):
    """``v`` as ``json.dumps`` writes it: tensors and NumPy scalars as Python numbers or
    lists, non-finite floats as None, recursively."""
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
    """(Re)write ``log.json`` and ``log.csv`` in ``out_dir`` from ``history``, atomically (stale
    temporaries removed first); CSV columns in order of first appearance."""
    for name in (LOG_JSON, LOG_CSV):
        remove_stale_temps(os.path.join(out_dir, name))
    rows = [{k: json_safe(v) for k, v in r.items()} for r in history]
    atomic_write(os.path.join(out_dir, LOG_JSON), json.dumps(rows, indent=1).encode("utf-8"))
    cols = list(dict.fromkeys(k for r in rows for k in r))  # in order of first appearance
    sio = io.StringIO()
    w = csv.DictWriter(sio, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(os.path.join(out_dir, LOG_CSV), sio.getvalue().encode("utf-8"))
