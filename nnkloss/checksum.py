"""Checkpoint files with a checksum: a sha256 of the payload stored before it, verified before
the payload is unpickled (weights-only), so a flipped bit or a torn copy is an error naming the
file, never a silently different bank or model.

Layout: the line ``nnkloss-sha256``, the 64 hex digits of the payload's sha256 and a newline,
then the payload, ``torch.save`` of the object, written with :func:`nnkloss.atomic.atomic_write`
(the whole file is read into memory to check it). The checksum detects damage, not forgery:
what a file with a matching checksum can do is bounded by the weights-only load and the
validation of what it holds.

Before a payload is unpickled, :func:`load_weights_only` refuses a zip archive with a
compressed record (``torch.save`` writes none, and ``torch.load`` would inflate one to
whatever size it declares) or records declaring more bytes than the file holds; after the load,
a tensor with more elements than its storage holds bytes for (a stride-0 view, whose first copy
would allocate what the file never held).
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
# The first bytes of a zip archive (a local file header), torch.load's own test for its format.
ZIP_MAGIC = b"PK\x03\x04"


class UncheckedFileError(ValueError):
    """The file has no checksum header (written by an older nnkloss, or not an nnkloss file).
    ``archive``: whether it is a torch.save archive at all (only then can it be an older
    nnkloss file)."""

    def __init__(self, message: str, archive: bool):
        super().__init__(message)
        self.archive = archive


def save_checked(obj: Any, path, name: str = "path") -> str:
    """``torch.save(obj)`` behind its sha256, written atomically to ``path``; returns the path.
    ``name`` is the argument named when ``path``'s directory does not exist."""
    # What load_checked would refuse is refused here, before anything is written.
    _check_tensors(obj, f"{name} {os.fspath(path)!r}",
                   failure="cannot be saved (load_checked would refuse it; save a contiguous "
                           "copy)")
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
    elif data.startswith(ZIP_MAGIC):
        raise UncheckedFileError(f"{where} is not a readable nnkloss file: it has no "
                                 "checksum (written before checksums, or not an nnkloss file)",
                                 archive=True)
    else:
        raise UncheckedFileError(f"{where} is not a readable nnkloss file: it has no checksum "
                                 "and is not a torch.save archive", archive=False)
    return load_weights_only(source, map_location, where)


def _check_archive(source, where: str) -> None:
    """Refuse a zip archive that would inflate beyond its own size (see the module docstring).
    ``source``: a path or a seekable binary file (its position is kept). Legacy non-zip files
    are left to torch.load, which checks their storages against the bytes it reads."""
    is_path = isinstance(source, (str, bytes, os.PathLike))
    if is_path:
        size = os.path.getsize(source)
        with open(source, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    else:
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
        if not is_path:
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
    """``torch.load(source, weights_only=True)`` after :func:`_check_archive`: no code runs
    from the file and no record inflates beyond the file's size. ``source``: a path or a
    seekable binary file. Every failure to read is a ValueError beginning with ``where``."""
    _check_archive(source, where)
    try:
        obj = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:  # foreign objects (refused by the weights-only unpickler), junk
        raise ValueError(f"{where} cannot be read safely "
                         f"({type(exc).__name__}: {exc})") from exc
    _check_tensors(obj, where)
    return obj


def iter_contents(obj: Any, root: str = "") -> Iterator[Tuple[str, Any]]:
    """Yield ``(path, value)`` for ``obj`` and everything in it through dicts, lists and
    tuples, depth first in order (``path`` like ``root['key'][2]``), each container once (a
    pickle can make a list hold itself). The one walk of the checkpoint checks."""
    stack, seen = [(root, obj)], set()
    while stack:
        at, o = stack.pop()
        if isinstance(o, (dict, list, tuple)):
            if id(o) in seen:
                continue
            seen.add(id(o))
        yield at, o
        # reversed onto the stack: the entries come off in the container's order
        if isinstance(o, dict):
            stack.extend(reversed([(f"{at}[{k!r}]", v) for k, v in o.items()]))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed([(f"{at}[{i}]", v) for i, v in enumerate(o)]))


def _check_tensors(obj: Any, where: str, failure: str = "cannot be read safely") -> None:
    """Refuse any tensor in ``obj`` that is not a strided tensor with values (not meta) whose
    elements all have bytes of their own in its storage: the weights-only unpickler rebuilds a
    stride-0 view as declared, and its first copy would allocate every element."""
    for at, o in iter_contents(obj):
        if not isinstance(o, torch.Tensor):
            continue
        if o.layout != torch.strided:
            raise ValueError(f"{where} {failure}: {at or 'its object'} is a "
                             f"{o.layout} tensor; only strided tensors are read")
        if o.is_meta:
            raise ValueError(f"{where} {failure}: {at or 'its object'} is a tensor on "
                             "the meta device, which holds no values")
        need = o.numel() * o.element_size()
        have = o.untyped_storage().nbytes() - o.storage_offset() * o.element_size()
        if need > have:
            raise ValueError(f"{where} {failure}: {at or 'its object'} of "
                             f"shape {tuple(o.shape)} and strides {o.stride()} covers "
                             f"{need} bytes, its storage holds {have}: a view whose "
                             "first copy would grow beyond the file")
