"""Atomic file writes: a temporary file in the same directory, fsync, then rename.

A crash or an error mid-write leaves the previous file intact and no temporary
behind; ``os.replace`` is atomic on POSIX and Windows.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["write_atomically"]


def write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Call ``write(binary_file)`` on a temporary file, then rename it over ``path``.

    An ``OSError`` of the file system (no space left, permission denied, a name too
    long) is raised again with ``filename`` set to ``path``, the file the caller meant,
    not the temporary one: the message can name it."""
    path = Path(path)
    try:
        _write(path, write)
    except OSError as e:
        if e.errno is None or e.filename == str(path):
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from e


def _write(path: Path, write: Callable[[Any], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
