"""The one atomic file writer, and the names of the temporaries it leaves when killed."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from typing import IO, Any

__all__ = ["atomic_write", "temporary_pattern"]

# mkstemp names: prefix + 8 characters of this alphabet + suffix (CPython's tempfile)
_RANDOM = "[a-z0-9_]{8}"


def temporary_pattern(path: str | os.PathLike) -> re.Pattern[str]:
    """The file names (in ``path``'s directory) of the temporaries :func:`atomic_write` creates
    for ``path``: ``<name>.<8 random characters>.tmp``."""
    return re.compile(re.escape(os.path.basename(os.fspath(path))) + rf"\.{_RANDOM}\.tmp")


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], binary: bool = True) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a temporary file in the same directory
    (named as :func:`temporary_pattern` says), which is flushed, fsynced and renamed over
    ``path`` (the directory fsynced too). A process killed at any point leaves either the
    previous file or the new one, never a torn one; it may leave its temporary behind."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable; not every platform/filesystem allows it
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
