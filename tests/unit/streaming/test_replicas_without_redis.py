"""Two replicas sharing one store, without a redis-server.

The replica logic (heartbeats, a cancel recorded in the store by another replica, taking over a
session whose owner stopped heartbeating) lives in the session and the manager, not in the
store. ``SharedSQLiteStore`` is one SQLite file opened by both replicas that says it is shared,
as Redis does, so that logic runs here on every machine; test_redis_replicas.py repeats the
scenarios on a real Redis where one is installed.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from vlmserve.streaming import (
    DONE,
    Emit,
    Event,
    Resumption,
    SessionManager,
    SessionRecord,
    SessionState,
    SQLiteStore,
)

pytestmark = pytest.mark.timeout(30)

N = 30


class SharedSQLiteStore(SQLiteStore):
    """Every new session, append, state change and heartbeat is in the tables when it returns
    (not only in this process's journal), so the other replica reads it as it would Redis."""

    shared = True  # type: ignore[misc]
    append_now = None  # type: ignore[assignment]  # sessions await ``append``

    async def append(self, session_id: str, event: Event) -> None:
        SQLiteStore.append_now(self, session_id, event)
        await self._flush()

    async def create(self, record: SessionRecord) -> None:
        await super().create(record)
        await self._flush()

    async def set_state(self, session_id: str, state: SessionState) -> None:
        await super().set_state(session_id, state)
        await self._flush()

    async def heartbeat(self, session_id: str, owner: str) -> None:
        await super().heartbeat(session_id, owner)
        await self._flush()


@pytest.fixture
async def replicas(tmp_path: Path):
    path = tmp_path / "shared.db"
    store_a = SharedSQLiteStore(path, poll_interval=0.01)
    store_b = SharedSQLiteStore(path, poll_interval=0.01)
    a = SessionManager(store_a, owner="A", heartbeat_interval=0.05, stale_after=0.5)
    b = SessionManager(
        store_b, owner="B", heartbeat_interval=0.05, stale_after=0.5, follow_poll=0.1
    )
    yield a, b
    for manager in (a, b):
        await manager.close()
        await manager.store.close()


async def test_b_follows_a_live_stream_of_a_to_the_end(replicas, producer, callbacks, drain):
    a, b = replicas
    await a.start("s1", {}, producer(N, delay=0.002), aliases=["chatcmpl-1"], **callbacks)
    first = await asyncio.wait_for(drain(a.listen("s1"), limit=10), 10)
    assert b.get("s1") is None  # not held by B: it follows the store
    rest = await asyncio.wait_for(drain(b.listen("chatcmpl-1", after=9)), 10)
    assert [e.index for e in first + rest] == list(range(N + 1))
    assert rest[-1].data == DONE and b.get("s1") is None  # followed, never taken over


async def test_heartbeats_keep_a_quiet_session_owned_by_a(replicas, callbacks, drain):
    a, b = replicas
    gate = asyncio.Event()

    async def quiet():
        yield _emit(0)
        await gate.wait()  # longer than stale_after without a single event
        yield _emit(1)

    await a.start("s1", {}, quiet(), **callbacks)
    await asyncio.sleep(0.8)  # > stale_after: only heartbeats show A is alive
    record = await b.store.get("s1")
    assert record.owner == "A" and time.time() - record.updated_at < 0.5
    listener = b.listen("s1")
    assert (await anext(listener)).index == 0
    gate.set()
    rest = await asyncio.wait_for(drain(listener), 10)
    assert [e.index for e in rest] == [1, 2] and b.get("s1") is None  # followed, not taken


async def test_b_cancels_a_stream_that_a_produces(replicas, producer, callbacks, counter, drain):
    a, b = replicas
    await a.start("s1", {}, producer(10_000, delay=0.002, counter=counter), **callbacks)
    await asyncio.sleep(0.05)
    assert await b.cancel("s1")
    await asyncio.wait_for(a.get("s1").wait(), 5)  # A notices at its next heartbeat
    assert a.get("s1").state is SessionState.CANCELLED and counter.closed
    events = await asyncio.wait_for(drain(b.listen("s1")), 10)
    assert json.loads(events[-2].data) == {"cancelled": True} and events[-1].data == DONE
    assert [e.index for e in events] == list(range(len(events)))


async def test_b_takes_over_when_a_stops_heartbeating(replicas, producer, callbacks, drain):
    a, b = replicas

    async def resume(record, events):
        return Resumption(producer(20, start=len(events)), on_cancel=list, on_error=lambda e: [])

    b.set_resumer(resume)
    gate = asyncio.Event()

    async def stalls():
        async for emit in producer(5):
            yield emit
        await gate.wait()

    await a.start("s1", {}, stalls(), **callbacks)
    events = await asyncio.wait_for(drain(b.listen("s1"), limit=5), 10)
    await a.close()  # A dies: no more heartbeats
    rest = await asyncio.wait_for(drain(b.listen("s1", after=4)), 10)
    assert [e.index for e in events + rest] == list(range(21))
    assert (await b.store.get("s1")).owner == "B"
    assert b.get("s1").state is SessionState.FINISHED


def _emit(i: int) -> Emit:
    return Emit(json.dumps({"i": i}))
