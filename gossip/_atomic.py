"""Atomic file writes: a temporary file in the same directory, fsync, then rename.

A crash or an error mid-write leaves the previous file intact and no temporary
behind; ``os.replace`` is atomic on POSIX and Windows. The file gets the mode any
file the process creates gets (``0o666`` less the umask: 0644 under umask 022, 0600
under 077), as the run directory's other files do; ``tempfile.mkstemp`` would make
every one 0600 whatever the umask.
"""

from __future__ import annotations

import os
import secrets
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


_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_BINARY", 0)


def _create_temp(path: Path) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` beside ``path``, created with mode 0o666 so that
    the umask decides its permissions (as ``open(path, "w")`` does)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, _FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name beside {path}")


def _write(path: Path, write: Callable[[Any], None]) -> None:
    fd, tmp = _create_temp(path)
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
