"""Checkpoint files with a checksum: a sha256 of the payload stored before it, verified before
the payload is unpickled (weights-only), so a flipped bit or a torn copy is an error naming the
file, never a silently different bank or model.

Layout: the line ``nnkloss-sha256``, the 64 hex digits of the payload's sha256 and a newline,
then the payload: ``torch.save`` of the object. The file is written with
:func:`nnkloss.atomic.atomic_write`. The checksum detects damage, not forgery: whoever can write
the file can write a matching checksum (what such a file can still do is bounded by the
weights-only load and the validation of what it holds).

The whole file is read into memory before it is checked (one extra copy of the payload while
loading).
"""
from __future__ import annotations

import hashlib
import io
import os
from typing import Any

import torch

from .atomic import atomic_write

__all__ = ["save_checked", "load_checked", "UncheckedFileError"]

MAGIC = b"nnkloss-sha256\n"


class UncheckedFileError(ValueError):
    """The file has no checksum header (written by an older nnkloss, or not an nnkloss file)."""


def save_checked(obj: Any, path, name: str = "path") -> str:
    """``torch.save(obj)`` behind its sha256, written atomically to ``path``; returns the path.
    ``name`` is the argument named when ``path``'s directory does not exist."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    digest = hashlib.sha256(payload).hexdigest().encode("ascii")

    def write(f):
        f.write(MAGIC)
        f.write(digest + b"\n")
        f.write(payload)
    return atomic_write(path, write, name=name)


def load_checked(path, map_location=None, what: str = "checkpoint",
                 allow_unchecked: bool = False, name: str = "path") -> Any:
    """Verify the checksum of the file at ``path``, then ``torch.load(weights_only=True)`` its
    payload. Every failure is a ValueError naming the file (FileNotFoundError when it does not
    exist); the messages say ``name`` (the argument) and ``what`` (the kind of file).

    ``allow_unchecked``: read a file without the checksum header as a plain weights-only
    ``torch.save`` file (files written before checksums); otherwise UncheckedFileError.
    """
    path = os.fspath(path)
    where = f"{name} {path!r} ({what})"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    header = len(MAGIC) + 65
    if data.startswith(MAGIC):
        digest, payload = data[len(MAGIC):header], memoryview(data)[header:]
        if (len(data) < header or digest[64:] != b"\n"
                or hashlib.sha256(payload).hexdigest().encode("ascii") != digest[:64]):
            raise ValueError(f"{where} does not match its sha256: the file is corrupt "
                             "(a flipped bit, a truncated or torn copy) or was modified")
        source = io.BytesIO(payload)
    elif allow_unchecked:
        source = io.BytesIO(data)
    else:
        raise UncheckedFileError(f"{where} is not a readable nnkloss file: it has no "
                                 "checksum (written before checksums, or not an nnkloss file)")
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:  # foreign objects (refused by the weights-only unpickler), junk
        raise ValueError(f"{where} cannot be read safely "
                         f"({type(exc).__name__}: {exc})") from exc
