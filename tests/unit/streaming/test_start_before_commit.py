"""A durable store: the producer starts while the session's row is committed, and no event
reaches the store before that row (the row's commit must not delay the stream's start)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vlmserve.errors import InvalidRequest
from vlmserve.streaming import DONE, SessionManager, SQLiteStore
from vlmserve.streaming.events import Event, SessionRecord

pytestmark = pytest.mark.timeout(30)
N = 200  # events: more than a session keeps in flight (16), so some follow the row's commit


class GatedStore(SQLiteStore):
    """SQLite whose ``create`` waits for ``gate``; records the order of creates and appends."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, ttl=60)
        self.gate = asyncio.Event()
        self.order: list[str] = []

    async def create(self, record: SessionRecord) -> None:
        await self.gate.wait()
        await super().create(record)
        self.order.append(f"create {record.session_id}")

    def append_now(self, session_id: str, event: Event) -> None:
        self.order.append(f"append {session_id} {event.index}")  # ``append`` comes here too
        super().append_now(session_id, event)


async def test_the_producer_runs_before_the_row_is_committed_and_events_follow_it(
    tmp_path: Path, producer, counter, callbacks, drain
) -> None:
    store = GatedStore(tmp_path / "s.db")
    manager = SessionManager(store)
    starting = asyncio.ensure_future(
        manager.start("s1", {"q": 1}, producer(N, counter=counter), **callbacks)
    )
    for _ in range(200):  # the producer gets going while the row's commit waits
        if counter.produced >= 3:
            break
        await asyncio.sleep(0.005)
    assert counter.produced >= 3 and not starting.done()
    assert store.order == []  # nothing reached the store before its session row
    store.gate.set()
    session = await asyncio.wait_for(starting, 5)
    events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
    assert [json.loads(e.data)["i"] for e in events[:-1]] == list(range(N))
    assert events[-1].data == DONE
    await asyncio.wait_for(session.wait(), 5)
    assert store.order[0] == "create s1"
    appended = [int(line.split()[-1]) for line in store.order[1:]]
    assert appended == list(range(N + 1))  # every event once, in order, after the row
    assert [e.index for e in await store.events("s1", -1)] == list(range(N + 1))
    # Once the row is in, events go to the journal as they come and reach the table many at
    # a time (each of the N + 1 in a transaction of its own would be N + 1 copies).
    assert store.flushes < N / 10
    await manager.close()


async def test_a_second_start_of_a_session_still_being_recorded_is_refused(
    tmp_path: Path, producer, callbacks, drain
) -> None:
    """The store cannot tell yet (the first row is not committed): the manager can."""
    store = GatedStore(tmp_path / "s.db")
    manager = SessionManager(store)
    first = asyncio.ensure_future(manager.start("s1", {}, producer(5), **callbacks))
    await asyncio.sleep(0.01)
    with pytest.raises(InvalidRequest, match="'s1' already exists"):
        await manager.start("s1", {}, producer(5), **callbacks)
    store.gate.set()
    await asyncio.wait_for(first, 5)
    assert manager.get("s1") is first.result()  # the first one is still the one held
    events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
    assert [e.index for e in events] == list(range(6))
    await manager.close()


async def test_an_id_taken_in_the_store_raises_and_stops_the_producer(
    tmp_path: Path, producer, counter, callbacks
) -> None:
    path = tmp_path / "s.db"
    first, second = SQLiteStore(path, ttl=60), GatedStore(path)
    other = SessionManager(first)  # another process that owns "s1" in the same file
    await asyncio.wait_for((await other.start("s1", {}, producer(3), **callbacks)).wait(), 5)
    await first.get("s1")  # its journal copied into the file, as it is within 0.1 s
    manager = SessionManager(second)
    starting = asyncio.ensure_future(  # no delay: a full window of events waits for the row
        manager.start("s1", {}, producer(10_000, counter=counter), aliases=["a1"], **callbacks)
    )
    while counter.produced < 16:
        await asyncio.sleep(0.001)
    second.gate.set()
    with pytest.raises(InvalidRequest, match="'s1' already exists"):
        await asyncio.wait_for(starting, 5)  # every held event fails with the row: no hang
    assert counter.closed and counter.produced < 10_000
    assert manager.get("s1") is None and manager.get("a1") is None
    assert [e.index for e in await first.events("s1", -1)] == [0, 1, 2, 3]  # untouched
    assert not [line for line in second.order if line.startswith("append")]
    await manager.close()
    await other.close()
    await second.close()
    await first.close()
