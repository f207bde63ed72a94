"""The embedded SQLite store: ``store.py`` (SQLiteStore), its per-process event journal
(``journal.py``), the journal's copies into the tables and the replay of dead processes'
journals (``copy.py``), and the sessions and aliases tables' lookups (``sessions.py``)."""

from vlmserve.streaming.store.sqlite.store import SQLiteStore

__all__ = ["SQLiteStore"]
