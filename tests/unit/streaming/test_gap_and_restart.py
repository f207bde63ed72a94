"""Ring overflow (gap vs store replay) and survival of a restart with SQLite."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vlmserve.streaming import (
    DONE,
    Emit,
    Event,
    MemoryStore,
    Resumption,
    SessionManager,
    SessionRecord,
    SessionState,
    SQLiteStore,
)

pytestmark = pytest.mark.timeout(30)

N = 30


async def test_resume_older_than_the_ring_gets_one_stream_gap_error_with_memory_store(
    producer, callbacks, drain
) -> None:
    manager = SessionManager(MemoryStore(), ring_size=8)
    session = await manager.start("s1", {}, producer(N), **callbacks)
    await asyncio.wait_for(session.wait(), 10)
    events = await asyncio.wait_for(drain(manager.listen("s1", after=4)), 10)
    assert len(events) == 1
    gap = events[0]
    assert gap.event == "error" and gap.index == 4  # the id the client already had
    assert json.loads(gap.data)["error"]["code"] == "stream_gap"
    # Inside the ring, resume still works.
    tail = await drain(manager.listen("s1", after=N - 4))
    assert [e.index for e in tail] == [N - 3, N - 2, N - 1, N]
    await manager.close()


async def test_resume_older_than_the_ring_replays_from_sqlite_without_gap(
    sqlite_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(sqlite_store, ring_size=8)
    await manager.start("s1", {}, producer(N, delay=0.001, every=3), **callbacks)
    first = await asyncio.wait_for(drain(manager.listen("s1"), limit=5), 10)
    await asyncio.wait_for(manager.get("s1").wait(), 10)  # the ring has moved far past index 4
    rest = await asyncio.wait_for(drain(manager.listen("s1", after=4)), 10)
    events = first + rest
    assert [e.index for e in events] == list(range(N + 1))
    assert events[-1].data == DONE
    await manager.close()


async def test_slow_listener_overtaken_by_the_ring_reads_the_store(
    sqlite_store, producer, callbacks
) -> None:
    manager = SessionManager(sqlite_store, ring_size=4)
    await manager.start("s1", {}, producer(N, delay=0.001), **callbacks)
    seen: list[int] = []
    async for event in manager.listen("s1"):
        seen.append(event.index)
        await asyncio.sleep(0.005)  # slower than the producer
    assert seen == list(range(N + 1))
    await manager.close()


def continuation(total: int) -> tuple[list[SessionRecord], object]:
    """A resumer that continues a numbered stream up to ``total`` items; records its calls."""
    calls: list[SessionRecord] = []

    async def resume(record: SessionRecord, events: list[Event]) -> Resumption:
        calls.append(record)
        done = [json.loads(e.data)["i"] for e in events]
        assert done == list(range(len(done)))  # got exactly the persisted events

        async def more():
            for i in range(len(done), total):
                await asyncio.sleep(0.001)
                yield Emit(json.dumps({"i": i}))

        return Resumption(more(), on_cancel=list, on_error=lambda exc: [])

    return calls, resume


async def crashed_midstream(path: Path, producer, callbacks, k: int = 12) -> str:
    """Manager A produces into ``path`` and is shut down (like a crash) after ``k`` events."""
    store_a = SQLiteStore(path)
    manager_a = SessionManager(store_a, owner="A")
    gate = asyncio.Event()

    async def stalls():
        async for emit in producer(k):
            yield emit
        await gate.wait()  # never set: A dies here, mid-generation

    session = await manager_a.start("s1", {"prompt": "hi"}, stalls(), **callbacks)
    while session.last_index < k - 1:
        await asyncio.sleep(0.001)
    await manager_a.close()  # no state change: resumable like a crash
    await store_a.close()
    return "s1"


async def test_sqlite_restart_with_a_resumer_continues_with_contiguous_indices(
    tmp_path, producer, callbacks, drain
) -> None:
    path = tmp_path / "s.db"
    sid = await crashed_midstream(path, producer, callbacks)
    store_b = SQLiteStore(path)
    assert (await store_b.get(sid)).state is SessionState.RUNNING
    manager_b = SessionManager(store_b, owner="B")
    calls, resume = continuation(N)
    manager_b.set_resumer(resume)
    a, b = await asyncio.wait_for(
        asyncio.gather(drain(manager_b.listen(sid)), drain(manager_b.listen(sid, after=5))), 10
    )
    assert len(calls) == 1  # two listeners, one takeover
    assert calls[0].owner == "A" and calls[0].request == {"prompt": "hi"}
    assert [e.index for e in a] == list(range(N + 1))
    assert [json.loads(e.data)["i"] for e in a[:-1]] == list(range(N))
    assert a[-1].data == DONE and b == a[6:]
    await manager_b.get(sid).wait()
    record = await store_b.get(sid)
    assert record.state is SessionState.FINISHED and record.owner == "B"
    await manager_b.close()
    await store_b.close()


async def test_sqlite_restart_without_a_resumer_ends_with_server_restart_error(
    tmp_path, producer, callbacks, drain
) -> None:
    path = tmp_path / "s.db"
    sid = await crashed_midstream(path, producer, callbacks, k=12)
    store_b = SQLiteStore(path)
    manager_b = SessionManager(store_b, owner="B")
    events = await asyncio.wait_for(drain(manager_b.listen(sid)), 10)
    assert [e.index for e in events] == list(range(14))
    assert events[12].event == "error"
    assert json.loads(events[12].data)["error"]["code"] == "server_restart"
    assert events[13].data == DONE
    assert (await store_b.get(sid)).state is SessionState.FAILED
    await manager_b.close()
    await store_b.close()


async def test_sqlite_gc_drops_expired_sessions_and_their_events(
    tmp_path, producer, callbacks
) -> None:
    store = SQLiteStore(tmp_path / "s.db", ttl=60)
    manager = SessionManager(store, ttl=60)
    session = await manager.start("old", {}, producer(5), aliases=["old-alias"], **callbacks)
    await session.wait()
    assert await manager.gc() == 0  # nothing expired yet
    later = session.record.updated_at + 61
    assert await manager.gc(now=later) == 2  # one in memory, one in the store
    assert manager.get("old") is None
    assert await store.get("old") is None and await store.get("old-alias") is None
    assert await store.events("old", -1) == []
    await manager.close()
    await store.close()
