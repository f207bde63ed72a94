"""The SQLite store's copies of its journal into the tables (on the store's own thread), and
the replay of the journals a dead process left (when a store opens the database).

One copy is one transaction: new sessions first, then events, then state and owner changes in
the order they were made (a session's own changes always follow its creation in the journal),
then the ``updated_at`` refreshes. Everything is ``INSERT OR IGNORE``: a journal replayed
twice (a crash after its copy, before its file was deleted) changes nothing.

Events go in as multi-row INSERTs, a few statements per copy rather than one per event:
SQLite releases the GIL around each statement, and while the event loop's thread is busy each
release is a hand-over of the GIL between the threads (``python benchmarks/stores.py --gil``:
copies of 272 events beside a busy thread, one INSERT per event against this module's copy;
figures in docs/performance.md).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from pathlib import Path
from typing import TypeVar

from vlmserve.streaming.store.sqlite.journal import (
    UPDATED_COLUMNS,
    Create,
    Entry,
    Row,
    Update,
    is_create,
    is_event,
    is_update,
    leftovers,
    read_rows,
)

__all__ = ["copy_entries", "events_of", "replay"]

T = TypeVar("T")
log = logging.getLogger(__name__)

_UPDATE = {
    column: f"UPDATE sessions SET {column} = ?, updated_at = ? WHERE session_id = ?"
    for column in UPDATED_COLUMNS
}


def copy_entries(conn: sqlite3.Connection, entries: list[Entry], touch: list[str]) -> None:
    """``entries`` into the tables in one transaction; ``touch``: sessions whose
    ``updated_at`` is set to now."""
    per = _rows_per_insert(conn)
    with conn:
        for sid, *columns, aliases in _creates(entries):
            conn.execute(
                "INSERT OR IGNORE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)", (sid, *columns)
            )
            conn.executemany(
                "INSERT OR IGNORE INTO aliases VALUES (?, ?)", [(alias, sid) for alias in aliases]
            )
        for part in _chunks(events_of(entries), per):
            conn.execute(_insert_sql(len(part)), [value for row in part for value in row])
        for sid, column, value, at in _updates(entries):
            conn.execute(_UPDATE[column], (value, at, sid))
        for sids in _chunks(list(dict.fromkeys(touch)), per * 6 - 1):
            marks = ", ".join("?" * len(sids))
            sql = f"UPDATE sessions SET updated_at = ? WHERE session_id IN ({marks})"
            conn.execute(sql, [time.time(), *sids])


def replay(conn: sqlite3.Connection, db: Path) -> None:
    """Copy the journals that dead processes left into the tables, then delete them."""
    for file in leftovers(db):
        entries = read_rows(file.path)
        copy_entries(conn, entries, [])
        file.close(delete=True)
        log.info("replayed %d journaled entries from %s", len(entries), file.path.name)


def events_of(entries: list[Entry]) -> list[Row]:
    return [e for e in entries if is_event(e)]


def _updates(entries: list[Entry]) -> list[Update]:
    return [e for e in entries if is_update(e)]


def _creates(entries: list[Entry]) -> list[Create]:
    return [e for e in entries if is_create(e)]


def _chunks(items: list[T], size: int) -> list[list[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _rows_per_insert(conn: sqlite3.Connection) -> int:
    """Events per INSERT: SQLite's limit on a statement's parameters over 6 columns, at most
    1,000 (the limit is 32,766 since SQLite 3.32, 999 before; Python 3.10 cannot ask)."""
    getlimit = getattr(conn, "getlimit", None)
    limit = 999 if getlimit is None else getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)  # type: ignore[attr-defined,unused-ignore]
    return max(1, min(1000, limit // 6))


@functools.lru_cache(maxsize=64)
def _insert_sql(rows: int) -> str:
    return "INSERT OR IGNORE INTO events VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?)"] * rows)
