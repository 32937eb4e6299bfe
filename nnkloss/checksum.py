"""Checkpoint files with a sha256 verified before the weights-only load (it detects damage, not
forgery). Layout: ``nnkloss-sha256\\n``, the hex digest and a newline, the ``torch.save`` payload.
"""
from __future__ import annotations

import hashlib
import io
import os
import zipfile
from typing import Any, Iterator, Tuple

import torch

from .atomic import atomic_write

__all__ = ["save_checked", "load_checked", "load_weights_only", "UncheckedFileError"]

MAGIC = b"nnkloss-sha256\n"
# The first bytes of a zip archive, torch.load's own test for its format.
ZIP_MAGIC = b"PK\x03\x04"


class UncheckedFileError(ValueError):
    """The file has no checksum header; ``archive``: whether it is a torch.save archive."""

    def __init__(self, message: str, archive: bool):
        super().__init__(message)
        self.archive = archive


def save_checked(obj: Any, path) -> str:
    """``torch.save(obj)`` behind its sha256, written atomically to ``path``; returns the path.
    What :func:`load_checked` would refuse is refused first."""
    _check_tensors(obj, f"path {os.fspath(path)!r}",
                   failure="cannot be saved (load_checked would refuse it; save a contiguous "
                           "copy)")
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    digest = hashlib.sha256(payload).hexdigest().encode("ascii")

    def write(f):
        f.write(MAGIC + digest + b"\n")
        f.write(payload)
    return atomic_write(path, write)


def load_checked(path, map_location=None, what: str = "checkpoint",
                 allow_unchecked: bool = False) -> Any:
    """Verify the checksum at ``path``, then load the payload weights-only. Failures are
    ValueErrors naming the file and ``what`` (FileNotFoundError where it is missing).
    ``allow_unchecked``: read a file without a header as plain ``torch.save`` (otherwise
    UncheckedFileError)."""
    path = os.fspath(path)
    where = f"path {path!r} ({what})"
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
        archive = data.startswith(ZIP_MAGIC)
        raise UncheckedFileError(f"{where} is not a readable nnkloss file: it has no checksum " + (
            "(written before checksums, or not an nnkloss file)" if archive
            else "and is not a torch.save archive"), archive)
    return load_weights_only(source, map_location, where)


def _check_archive(source, where: str) -> None:
    """Refuse a zip archive (path or seekable file, position kept) that would inflate beyond
    its size; non-zip files are left to torch.load."""
    if isinstance(source, (str, bytes, os.PathLike)):
        with open(source, "rb") as f:
            return _check_archive(f, where)
    pos = source.tell()
    head = source.read(len(ZIP_MAGIC))
    size = source.seek(0, io.SEEK_END)
    source.seek(pos)
    if head != ZIP_MAGIC:
        return
    try:
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{where} cannot be read safely (not a readable zip archive: "
                         f"{exc})") from None
    finally:
        source.seek(pos)
    declared = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{where} cannot be read safely: its record {info.filename!r} is "
                             f"compressed (to inflate to {info.file_size} bytes); torch.save "
                             "stores every record uncompressed")
        declared += info.file_size
    if declared > size:
        raise ValueError(f"{where} cannot be read safely: its records declare {declared} "
                         f"bytes, more than the file's {size}")


def load_weights_only(source, map_location=None, where: str = "file") -> Any:
    """``torch.load(source, weights_only=True)`` after the archive and tensor checks;
    ``source``: a path or seekable binary file. Failures: ValueError beginning with ``where``."""
    _check_archive(source, where)
    try:
        obj = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:  # foreign objects (refused by the weights-only unpickler), junk
        raise ValueError(f"{where} cannot be read safely ({type(exc).__name__}: {exc})") from exc
    _check_tensors(obj, where)
    return obj


def iter_contents(obj: Any, root: str = "") -> Iterator[Tuple[str, Any]]:
    """Yield ``(path, value)`` for ``obj`` and everything in its dicts, lists and tuples, depth
    first (``path`` like ``root['key'][2]``), each container once."""
    stack, seen = [(root, obj)], set()
    while stack:
        at, o = stack.pop()
        if isinstance(o, (dict, list, tuple)):
            if id(o) in seen:
                continue
            seen.add(id(o))
        yield at, o
        if isinstance(o, dict):
            stack.extend(reversed([(f"{at}[{k!r}]", v) for k, v in o.items()]))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed([(f"{at}[{i}]", v) for i, v in enumerate(o)]))


def _check_tensors(obj: Any, where: str, failure: str = "cannot be read safely") -> None:
    """Refuse any tensor in ``obj`` that is not strided, is meta, or whose elements lack bytes
    of their own in its storage (a stride-0 view would grow at its first copy)."""
    for at, o in iter_contents(obj):
        if not isinstance(o, torch.Tensor):
            continue
        head = f"{where} {failure}: {at or 'its object'}"
        if o.layout != torch.strided:
            raise ValueError(f"{head} is a {o.layout} tensor; only strided tensors are read")
        if o.is_meta:
            raise ValueError(f"{head} is a tensor on the meta device, which holds no values")
        need = o.numel() * o.element_size()
        have = o.untyped_storage().nbytes() - o.storage_offset() * o.element_size()
        if need > have:
            raise ValueError(f"{head} of shape {tuple(o.shape)} and strides {o.stride()} covers "
                             f"{need} bytes, its storage holds {have}: a view whose first copy "
                             "would grow beyond the file")
