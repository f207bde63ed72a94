"""One Session on its own: listener counting, the idle timer, heartbeats, the ring.

Heartbeats and store-side cancels matter most with Redis, but their logic does not depend on
the store: here a ``RecordingStore`` wraps a MemoryStore (and can claim to be shared) so it runs
without a redis-server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import pytest
from session_fakes import RecordingStore, stalled, started, wait_until

from vlmserve.streaming import (
    DONE,
    Emit,
    Event,
    MemoryStore,
    SessionManager,
    SessionRecord,
    SessionState,
)
from vlmserve.streaming.session import Session, SessionOptions

pytestmark = pytest.mark.timeout(30)


# -- listeners and the idle timer -------------------------------------------------------------


async def test_with_two_listeners_one_leaving_does_not_arm_the_idle_timer(
    producer, callbacks
) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0.1)
    session = await manager.start("s1", {}, producer(10**6, delay=0.002), **callbacks)
    first, second = manager.listen("s1"), manager.listen("s1")
    await anext(first)
    await anext(second)
    assert session.listeners == 2
    await first.aclose()
    assert session.listeners == 1
    await asyncio.sleep(0.3)  # three times the delay
    assert session.state is SessionState.RUNNING
    more = [await anext(second) for _ in range(5)]  # the remaining listener still reads
    assert [e.index for e in more] == list(range(more[0].index, more[0].index + 5))
    await second.aclose()
    assert session.listeners == 0
    await asyncio.wait_for(session.wait(), 2)  # now the timer is armed and fires
    assert session.state is SessionState.CANCELLED
    await manager.close()


async def test_the_idle_cancel_is_logged_with_its_delay(producer, callbacks, caplog) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0.05)
    caplog.set_level(logging.INFO, logger="vlmserve.streaming.session")
    session = await manager.start("s1", {}, producer(10**6, delay=0.002), **callbacks)
    await asyncio.wait_for(session.wait(), 2)
    assert "session s1: no listener for 0.1s, cancelled" in caplog.messages
    await manager.close()


async def test_a_session_that_ends_by_itself_is_not_cancelled_by_a_pending_timer(
    producer, callbacks
) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0.05)
    session = await manager.start("s1", {}, producer(3), **callbacks)
    await asyncio.wait_for(session.wait(), 2)
    await asyncio.sleep(0.1)
    assert session.state is SessionState.FINISHED
    await manager.close()


# -- heartbeats -------------------------------------------------------------------------------


async def test_heartbeats_refresh_the_record_while_the_producer_is_quiet() -> None:
    store = RecordingStore()
    session, gate = await started(store, heartbeat_interval=0.02)
    before = (await store.get("s1")).updated_at
    await wait_until(lambda: len(store.beats) >= 3)
    assert set(store.beats) == {("s1", "me")}
    record = await store.get("s1")
    assert record.updated_at > before and record.owner == "me"
    assert store.gets == 2  # a store only this process uses is never polled for cancels
    gate.set()
    await asyncio.wait_for(session.wait(), 2)
    beats = len(store.beats)
    await asyncio.sleep(0.1)
    assert len(store.beats) == beats  # no heartbeats once the session has ended


async def test_zero_heartbeat_interval_sends_no_heartbeats() -> None:
    store = RecordingStore()
    session, gate = await started(store, heartbeat_interval=0)
    await asyncio.sleep(0.1)
    assert store.beats == []
    gate.set()
    await asyncio.wait_for(session.wait(), 2)


async def test_a_failing_heartbeat_is_retried_and_does_not_end_the_session(caplog) -> None:
    store = RecordingStore()
    store.fail.add("heartbeat")
    session, gate = await started(store, heartbeat_interval=0.02)
    await wait_until(lambda: len(store.beats) >= 3)
    assert session.state is SessionState.RUNNING
    assert "session s1: heartbeat failed" in caplog.messages
    gate.set()
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.FINISHED


async def test_a_shared_store_is_polled_and_a_cancel_recorded_there_ends_the_session() -> None:
    store = RecordingStore(shared=True)
    session, _ = await started(store, heartbeat_interval=0.02, cancel_after_disconnect=0)
    await wait_until(lambda: store.gets >= 3)
    assert session.state is SessionState.RUNNING  # polled, still running: nothing happens
    await store.set_state("s1", SessionState.CANCELLED)  # another replica cancelled it
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.CANCELLED
    events = [e async for e in session.stream(-1)]
    assert [e.index for e in events] == [0, 1, 2, 3] and events[-1].data == DONE


async def test_a_vanished_record_in_a_shared_store_does_not_cancel() -> None:
    store = RecordingStore(shared=True)
    session, gate = await started(store, heartbeat_interval=0.02)
    await store.close()  # the record is gone (expired in the store)
    gets = store.gets
    await wait_until(lambda: store.gets >= gets + 3)
    assert session.state is SessionState.RUNNING
    gate.set()
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.FINISHED


# -- the ring ---------------------------------------------------------------------------------


def bare_session(ring_size: int) -> Session:
    now = time.time()
    record = SessionRecord("s1", {}, SessionState.RUNNING, now, now)
    return Session(record, MemoryStore(), SessionOptions(ring_size=ring_size))


def test_seed_keeps_the_newest_events_and_continues_after_the_last() -> None:
    session = bare_session(3)
    session.seed([Event(i, str(i)) for i in range(5)])
    assert [e.index for e in session.ring] == [2, 3, 4]
    assert session.last_index == 4
    session.seed([])
    assert session.last_index == 4


def test_a_ring_size_below_one_still_holds_the_latest_event() -> None:
    session = bare_session(0)
    session.seed([Event(0, "a"), Event(1, "b")])
    assert [e.index for e in session.ring] == [1]


async def test_resume_at_the_oldest_event_of_the_ring_needs_no_store(drain) -> None:
    manager = SessionManager(MemoryStore(), ring_size=4)
    session = await manager.start(
        "s1",
        {},
        (Emit(str(i)) async for i in aiter_range(10)),
        on_cancel=list,
        on_error=lambda exc: [],
    )
    await asyncio.wait_for(session.wait(), 2)
    assert [e.index for e in session.ring] == [7, 8, 9, 10]
    assert [e.index for e in await drain(manager.listen("s1", after=6))] == [7, 8, 9, 10]
    assert [e.index for e in await drain(manager.listen("s1", after=8))] == [9, 10]
    gap = await drain(manager.listen("s1", after=5))
    assert [(e.index, e.event) for e in gap] == [(5, "error")]
    assert "events after s1:5 are no longer held" in json.loads(gap[0].data)["error"]["message"]
    await manager.close()


async def aiter_range(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


async def test_a_listener_waiting_for_the_next_event_ends_when_the_session_is_closed() -> None:
    manager = SessionManager(MemoryStore())
    _, gen = stalled(2)
    session = await manager.start("s1", {}, gen, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 1)
    seen: list[int] = []

    async def listen() -> None:
        async for event in session.stream(-1):
            seen.append(event.index)

    reader = asyncio.ensure_future(listen())
    await wait_until(lambda: seen == [0, 1])
    await session.close()  # shutdown: no terminal event, the listener just ends
    await asyncio.wait_for(reader, 2)
    assert seen == [0, 1] and session.listeners == 0
    await manager.close()


async def test_a_failed_heartbeat_is_logged_with_its_traceback(caplog) -> None:
    store = RecordingStore()
    store.fail.add("heartbeat")
    session, gate = await started(store, heartbeat_interval=0.02)
    await wait_until(lambda: len(store.beats) >= 1)
    await asyncio.sleep(0.01)
    failures = [r for r in caplog.records if r.getMessage() == "session s1: heartbeat failed"]
    assert failures and failures[0].exc_info and failures[0].exc_info[0] is ConnectionError
    gate.set()
    await asyncio.wait_for(session.wait(), 2)


async def test_a_listener_behind_an_empty_ring_gets_a_gap() -> None:
    """A session taken over from a store without events: it knows its last index, not them."""
    now = time.time()
    record = SessionRecord("s1", {}, SessionState.RUNNING, now, now, last_index=5)
    session = Session(record, MemoryStore())
    for after in (2, 4):
        events = [e async for e in session.stream(after)]
        assert [(e.index, e.event) for e in events] == [(after, "error")]
