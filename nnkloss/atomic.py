"""The package's one atomic file writer: readers see the old file or the new one, never half.

The data goes to a temporary file in the target's directory, is flushed and fsync'ed, then
renamed over the target with ``os.replace``; the directory is fsync'ed so that the rename itself
survives a crash. A failure at any point leaves the previous file intact and no temporary file.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, IO, Union

from .validation import require_parent_dir

__all__ = ["atomic_write"]


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable. Not possible on every platform/filesystem: best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, data: Union[bytes, Callable[[IO[bytes]], None]], name: str = "path"
                 ) -> str:
    """Write ``data`` (bytes, or a function that writes into a binary file object, e.g.
    ``lambda f: torch.save(obj, f)``) to ``path`` atomically. Returns the path.

    ``name`` is the argument named in the error when the target's directory does not exist.
    The file keeps the target's permissions (or gets 0644 when new).
    """
    path = require_parent_dir(name, path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        # mkstemp makes the file 0600; keep the target's mode (or a usual 0644) instead.
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    return path
