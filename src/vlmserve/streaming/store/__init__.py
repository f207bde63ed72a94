"""Session stores: MemoryStore (persistence off), SQLiteStore (embedded), RedisStore (shared)."""

from __future__ import annotations

from pathlib import Path

from vlmserve.streaming.store.base import SessionStore
from vlmserve.streaming.store.memory import MemoryStore
from vlmserve.streaming.store.redis import RedisStore
from vlmserve.streaming.store.sqlite import SQLiteStore

__all__ = ["MemoryStore", "RedisStore", "SQLiteStore", "SessionStore", "build_store"]


def build_store(
    *,
    persist: bool = False,
    db_path: str | Path = "sessions.db",
    redis_url: str | None = None,
    ttl: float = 600.0,
) -> SessionStore:
    """Redis when ``redis_url`` is set (shared by replicas), else SQLite when ``persist``,
    else memory only (streams survive neither a restart nor a ring-buffer overflow)."""
    if redis_url:
        return RedisStore(redis_url, ttl=ttl)
    if persist:
        return SQLiteStore(db_path, ttl=ttl)
    return MemoryStore(ttl=ttl)
