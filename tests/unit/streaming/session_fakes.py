"""Fakes for the Session tests: a recording MemoryStore, a stalling producer, polling."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from vlmserve.streaming import Emit, Event, MemoryStore, SessionManager, SessionRecord, SessionState
from vlmserve.streaming.session import Session


class RecordingStore(MemoryStore):
    """A MemoryStore that records heartbeats and ``get`` calls and can fail on demand."""

    def __init__(self, *, shared: bool = False) -> None:
        super().__init__(ttl=60)
        self.shared = shared  # type: ignore[misc]
        self.beats: list[tuple[str, str]] = []
        self.gets = 0
        self.fail: set[str] = set()  # names of methods that raise

    async def heartbeat(self, session_id: str, owner: str) -> None:
        self.beats.append((session_id, owner))
        if "heartbeat" in self.fail:
            raise ConnectionError("store down")
        await super().heartbeat(session_id, owner)

    async def get(self, session_id: str) -> SessionRecord | None:
        self.gets += 1
        return await super().get(session_id)

    async def set_state(self, session_id: str, state: SessionState) -> None:
        if "set_state" in self.fail:
            raise ConnectionError("store down")
        await super().set_state(session_id, state)

    def append_now(self, session_id: str, event: Event) -> None:  # ``append`` comes here too
        if "append" in self.fail:
            raise ConnectionError("store down")
        super().append_now(session_id, event)


def stalled(n: int) -> tuple[asyncio.Event, AsyncIterator[Emit]]:
    """A producer that yields ``n`` emits, then waits for the returned gate to be set."""
    gate = asyncio.Event()

    async def gen() -> AsyncIterator[Emit]:
        for i in range(n):
            yield Emit(json.dumps({"i": i}))
        await gate.wait()

    return gate, gen()


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def started(store, *, owner: str = "me", **options: float) -> tuple[Session, asyncio.Event]:
    """A session on ``store`` whose producer has made 3 events and then stalls."""
    manager = SessionManager(store, owner=owner, **options)  # type: ignore[arg-type]
    gate, gen = stalled(3)
    session = await manager.start("s1", {}, gen, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 2)
    return session, gate
