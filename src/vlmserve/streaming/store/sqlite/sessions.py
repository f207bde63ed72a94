"""The SQLite store's sessions and aliases tables: whether a name is taken, and lookups.

Called on the store's own thread (``store.py``) with its one connection.
"""

from __future__ import annotations

import json
import sqlite3

from vlmserve.streaming.events import SessionRecord, SessionState

__all__ = ["lookup", "taken_names"]


def taken_names(conn: sqlite3.Connection, names: tuple[str, ...]) -> str | None:
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
