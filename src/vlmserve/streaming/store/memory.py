"""MemoryStore: persistence off. Keeps records (cancel, aliases, state) but never events.

The session's ring buffer is then the only copy of its events, so a resume older than the ring
gets a ``stream_gap`` error and a restart loses every stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from vlmserve.streaming.events import Event, SessionRecord, SessionState
from vlmserve.streaming.store.base import already_exists

__all__ = ["MemoryStore"]


def _copy(record: SessionRecord) -> SessionRecord:
    return dataclasses.replace(record, request=dict(record.request), aliases=list(record.aliases))


class MemoryStore:
    shared = False
    durable = False  # events die with the process
    instant = True  # create and append never wait: a session starts once its row is in

    def __init__(self, ttl: float = 600.0) -> None:
        self.ttl = ttl
        self._records: dict[str, SessionRecord] = {}
        self._aliases: dict[str, str] = {}

    async def create(self, record: SessionRecord) -> None:
        for name in (record.session_id, *record.aliases):
            if name in self._records or name in self._aliases:
                raise already_exists(name)
        self._records[record.session_id] = _copy(record)
        for alias in record.aliases:
            self._aliases[alias] = record.session_id

    async def append(self, session_id: str, event: Event) -> None:
        self.append_now(session_id, event)

    def append_now(self, session_id: str, event: Event) -> None:
        record = self._records.get(session_id)
        if record is not None:
            record.last_index = max(record.last_index, event.index)
            record.updated_at = time.time()

    async def set_state(self, session_id: str, state: SessionState) -> None:
        record = self._records.get(session_id)
        if record is not None:
            record.state = state
            record.updated_at = time.time()

    async def heartbeat(self, session_id: str, owner: str) -> None:
        record = self._records.get(session_id)
        if record is not None:
            record.owner = owner
            record.updated_at = time.time()

    async def get(self, session_id: str) -> SessionRecord | None:
        record = self._records.get(session_id)
        if record is None and session_id in self._aliases:
            record = self._records.get(self._aliases[session_id])
        return None if record is None else _copy(record)

    async def events(self, session_id: str, after: int) -> list[Event]:
        return []

    async def wait_events(self, session_id: str, after: int, timeout: float) -> list[Event]:
        await asyncio.sleep(timeout)
        return []

    async def gc(self, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - self.ttl
        expired = [sid for sid, rec in self._records.items() if rec.updated_at < cutoff]
        for sid in expired:
            for alias in self._records.pop(sid).aliases:
                self._aliases.pop(alias, None)
        return len(expired)

    async def close(self) -> None:
        self._records.clear()
        self._aliases.clear()
