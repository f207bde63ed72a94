"""Stored data is private: files 0600 and directories 0700, whatever the process's umask.

SQLite creates a database's ``-wal``, ``-shm`` and ``-journal`` files with the database file's
own mode, so a database made here first (0600) keeps all of them private.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

__all__ = ["open_private", "private_db", "private_dir"]

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents) made; ``path`` itself 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path) -> BinaryIO:
    """``path`` opened for writing (created or truncated), 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb")


def private_db(path: Path) -> None:
    """Before ``sqlite3.connect(path)``: the database file exists and is 0600, as are the
    side files an earlier run left."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.chmod(side, FILE_MODE)
