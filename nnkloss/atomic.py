"""The package's one atomic file writer: a temporary beside the target, fsync'ed and renamed
over it, so readers see the old file or the new one, never half."""
from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import time
from typing import Callable, IO, List, Union

from .validation import require_parent_dir

__all__ = ["atomic_write", "remove_stale_temps"]


def atomic_write(path, data: Union[bytes, Callable[[IO[bytes]], None]]) -> str:
    """Write ``data`` (bytes, or a function writing into a binary file) to ``path``
    atomically; returns the path. The target's mode is kept (new: 0644 less the umask)."""
    path = require_parent_dir("path", path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=directory)
    try:
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644 & ~_umask()
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # makes the rename durable; best effort
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def _umask() -> int:
    """The umask from /proc/self/status (os.umask reads it only by setting it)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def remove_stale_temps(path, older_than_s: float = 0.0) -> List[str]:
    """Remove this user's temporaries of interrupted :func:`atomic_write` calls for ``path``
    untouched for ``older_than_s`` seconds; returns the paths removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # mkstemp's names: the prefix, eight of its random characters, the suffix.
    pattern = re.compile(re.escape(_temp_prefix(path)) + r"[a-z0-9_]{8}\.tmp")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in filter(pattern.fullmatch, names):
        tmp = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(tmp)  # never follows a link
            if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    and now - st.st_mtime >= older_than_s):
                os.unlink(tmp)
                removed.append(tmp)
    return removed
