"""The SQLite store's sessions and aliases tables: new records (group-committed) and lookups.

Called on the store's own thread (``sqlite.py``) with its one connection.
"""

from __future__ import annotations

import json
import sqlite3

from vlmserve.errors import InvalidRequest
from vlmserve.streaming.events import SessionRecord, SessionState
from vlmserve.streaming.store.base import already_exists, dump_request

__all__ = ["insert_records", "lookup"]


def insert_records(
    conn: sqlite3.Connection, records: list[SessionRecord]
) -> list[BaseException | None]:
    """One transaction for all ``records`` (a group commit); if it fails, each alone, so only
    a taken session id fails its own caller."""
    try:
        _insert_sessions(conn, records)
        return [None] * len(records)
    except (sqlite3.Error, InvalidRequest):
        pass
    results: list[BaseException | None] = []
    for record in records:
        try:
            _insert_sessions(conn, [record])
            results.append(None)
        except (sqlite3.Error, InvalidRequest) as exc:
            results.append(exc)
    return results


def _insert_sessions(conn: sqlite3.Connection, records: list[SessionRecord]) -> None:
    with conn:
        for record in records:
            _insert_session(conn, record)


def _insert_session(conn: sqlite3.Connection, record: SessionRecord) -> None:
    names = (record.session_id, *record.aliases)
    taken = _taken(conn, names)
    if taken is not None:
        raise already_exists(taken)
    conn.execute(
        "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)",
        (record.session_id, dump_request(record.request), record.state.value,
         record.created_at, record.updated_at, record.last_index, record.owner),
    )  # fmt: skip
    conn.executemany(
        "INSERT INTO aliases VALUES (?, ?)",
        [(alias, record.session_id) for alias in record.aliases],
    )


def _taken(conn: sqlite3.Connection, names: tuple[str, ...]) -> str | None:
    """One of ``names`` that is already a session's id or alias (one query, not a lookup of
    each name's whole record)."""
    marks = ", ".join("?" * len(names))
    found = conn.execute(
        f"SELECT session_id FROM sessions WHERE session_id IN ({marks}) "
        f"UNION ALL SELECT alias FROM aliases WHERE alias IN ({marks}) LIMIT 1",
        names + names,
    ).fetchone()
    return None if found is None else str(found[0])


def lookup(conn: sqlite3.Connection, name: str) -> SessionRecord | None:
    """The record whose id or alias is ``name``."""
    row = conn.execute("SELECT * FROM sessions WHERE session_id = ?", (name,)).fetchone()
    if row is None:
        alias = conn.execute("SELECT session_id FROM aliases WHERE alias = ?", (name,)).fetchone()
        if alias is None:
            return None
        row = conn.execute("SELECT * FROM sessions WHERE session_id = ?", alias).fetchone()
        if row is None:
            return None
    sid, request, state, created_at, updated_at, last_index, owner = row
    (newest,) = conn.execute("SELECT MAX(idx) FROM events WHERE session_id = ?", (sid,)).fetchone()
    last_index = max(last_index, -1 if newest is None else newest)
    aliases = [
        a
        for (a,) in conn.execute(
            "SELECT alias FROM aliases WHERE session_id = ? ORDER BY rowid", (sid,)
        )
    ]
    return SessionRecord(
        sid,
        json.loads(request),
        SessionState(state),
        created_at,
        updated_at,
        last_index,
        owner,
        aliases,
    )
