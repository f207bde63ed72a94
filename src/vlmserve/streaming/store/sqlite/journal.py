"""EventJournal: the SQLite store's events, appended to a plain file before anyone sees them.

A stream's event is durable once the operating system holds it: a process killed with
``kill -9`` loses nothing the kernel was given (a power cut may lose the newest, as SQLite's
``synchronous=NORMAL`` may). One ``write()`` of one line per event does that on the event
loop's thread in a few microseconds; the store copies the lines into SQLite later, many at
once (``store.py``). Committing each engine step to SQLite before sending it cost a thread
hop and a WAL transaction of whole pages per step: +50-70 us of CPU per event over the
memory store, against +14-28 us with the journal, measured in turn (``benchmarks/stores.py``).

Files: ``<db>.events-<owner>-<n>.jsonl`` beside the database, one line per new session
(``[session_id, request, state, created_at, updated_at, last_index, owner, aliases]``), per
event (``[session_id, index, event, data, meta, terminal]``) and per change of a session's
state or owner (``[session_id, "state" | "owner", value, time]``), in the order they happened. The
process writing a file holds an exclusive ``flock`` on it until its lines are in SQLite and the
file is deleted, so a file no one holds is a dead process's leftover: the store replays those
into SQLite when it opens. A torn last line (a power cut mid-write) ends that file's replay.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from vlmserve.streaming.events import SessionState

__all__ = [
    "Create",
    "Entry",
    "EventJournal",
    "JournalFile",
    "Update",
    "is_create",
    "is_event",
    "is_update",
    "leftovers",
    "read_rows",
]

log = logging.getLogger(__name__)
Row = tuple[str, int, str | None, str, str | None, int]  # as the events table's columns
Update = tuple[str, str, str, float]  # session id, column ("state" or "owner"), value, time
# as the sessions table's columns (request as JSON text), then the session's aliases
Create = tuple[str, str, str, float, float, int, str, tuple[str, ...]]
Entry = Row | Update | Create
UPDATED_COLUMNS = ("state", "owner")
_STATES = frozenset(state.value for state in SessionState)


def is_update(entry: Entry) -> TypeGuard[Update]:
    return len(entry) == 4


def is_event(entry: Entry) -> TypeGuard[Row]:
    return len(entry) == 6


def is_create(entry: Entry) -> TypeGuard[Create]:
    return len(entry) == 8


@dataclass(slots=True)
class JournalFile:
    """One open, locked journal file."""

    path: Path
    fd: int

    def close(self, delete: bool) -> None:
        """Delete (first, so no one else opens it) and release the lock."""
        if delete:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _pattern(db: Path) -> str:
    return f"{db.name}.events-*.jsonl"


def _open_locked(path: Path) -> JournalFile:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return JournalFile(path, fd)


class EventJournal:
    """This process's journal of one database: the file being written, rotated at each copy
    into SQLite (the copied file is deleted once its rows are committed)."""

    def __init__(self, db: Path) -> None:
        self._db = db
        self._owner = uuid.uuid4().hex[:12]
        self._seq = 0
        self.current = self._new_file()

    def _new_file(self) -> JournalFile:
        self._seq += 1
        return _open_locked(
            self._db.with_name(f"{self._db.name}.events-{self._owner}-{self._seq}.jsonl")
        )

    def write(self, entry: Entry) -> None:
        """Hand one entry's line to the kernel (it is durable when this returns)."""
        view = memoryview(_line(entry))
        while view:
            view = view[os.write(self.current.fd, view) :]

    def rotate(self) -> JournalFile:
        """Start a new file; the old one (still locked) is the caller's to close once its rows
        are committed."""
        old, self.current = self.current, self._new_file()
        return old


def _line(row: Entry) -> bytes:
    """orjson: 0.3 us against json.dumps' 3.6 us per line. A str that is not valid UTF-8 (a
    lone surrogate, which SQLite could not take either) fails the write, and so the append."""
    return orjson.dumps(row) + b"\n"


def leftovers(db: Path) -> list[JournalFile]:
    """Journal files of this database that no live process holds, locked for the caller."""
    found = []
    for path in sorted(db.parent.glob(_pattern(db))):
        try:
            found.append(_open_locked(path))
        except OSError:  # its writer is alive (or it was just deleted)
            continue
    return found


def read_rows(path: Path) -> list[Entry]:
    """A file's entries, up to a torn or unreadable line (logged)."""
    rows: list[Entry] = []
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:  # replayed and deleted by another process meanwhile
        return rows
    for number, line in enumerate(lines, 1):
        try:
            rows.append(_row(json.loads(line)))
        except (ValueError, TypeError):
            log.warning("journal %s: line %d is torn or corrupt; the rest is skipped", path, number)
            break
    return rows


def _row(value: Any) -> Entry:
    if isinstance(value, list) and len(value) == 4:
        return _update(value)
    if isinstance(value, list) and len(value) == 8:
        return _create(value)
    sid, index, event, data, meta, terminal = value
    if not isinstance(sid, str) or not isinstance(index, int) or not isinstance(data, str):
        raise TypeError("not an event row")
    return (sid, index, event, data, meta, int(terminal))


def _update(value: list[Any]) -> Update:
    sid, column, new, at = value
    if not (isinstance(sid, str) and column in UPDATED_COLUMNS and isinstance(new, str)):
        raise TypeError("not a session update")
    if not isinstance(at, (int, float)) or (column == "state" and new not in _STATES):
        raise TypeError("not a session update")
    return (sid, column, new, float(at))


def _create(value: list[Any]) -> Create:
    sid, request, state, created_at, updated_at, last_index, owner, aliases = value
    texts = (sid, request, owner, *aliases) if isinstance(aliases, list) else (None,)
    if not all(isinstance(t, str) for t in texts) or state not in _STATES:
        raise TypeError("not a new session")
    times = (created_at, updated_at)
    if not isinstance(last_index, int) or not all(isinstance(t, (int, float)) for t in times):
        raise TypeError("not a new session")
    return (
        sid,
        request,
        state,
        float(created_at),
        float(updated_at),
        last_index,
        owner,
        tuple(aliases),
    )
