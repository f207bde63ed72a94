"""cancel() and the auto-cancel timer armed when the last listener leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from vlmserve.streaming import DONE, MemoryStore, SessionManager, SessionState

pytestmark = pytest.mark.timeout(30)


async def test_cancel_stops_the_producer_and_ends_the_stream(
    any_store, producer, callbacks, counter, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(100_000, delay=0.001, counter=counter), **callbacks)
    listener = manager.listen("s1")
    seen = [await anext(listener) for _ in range(5)]
    assert await manager.cancel("s1")
    stopped_at = counter.produced
    await asyncio.sleep(0.05)
    assert counter.produced == stopped_at and counter.closed  # the producer really stopped
    seen += await asyncio.wait_for(drain(listener), 5)
    assert [e.index for e in seen] == list(range(len(seen)))
    assert json.loads(seen[-2].data) == {"cancelled": True}  # on_cancel's emit, then [DONE]
    assert seen[-1].data == DONE and seen[-1].terminal
    assert manager.get("s1").state is SessionState.CANCELLED
    assert (await any_store.get("s1")).state is SessionState.CANCELLED
    assert not await manager.cancel("s1")  # already final
    await manager.close()


async def test_cancel_by_alias_and_unknown_ids(any_store, producer, callbacks, counter) -> None:
    manager = SessionManager(any_store)
    await manager.start(
        "s1",
        {},
        producer(100_000, delay=0.001, counter=counter),
        aliases=["chatcmpl-9"],
        **callbacks,
    )
    assert not await manager.cancel("unknown")
    assert await manager.cancel("chatcmpl-9")
    assert manager.get("s1").state is SessionState.CANCELLED and counter.closed
    await manager.close()


async def test_cancel_right_after_start_still_ends_with_done(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(100), **callbacks)
    assert await manager.cancel("s1")  # before the producer task ever ran
    events = await asyncio.wait_for(drain(manager.listen("s1")), 5)
    assert events[-1].data == DONE
    assert [e.index for e in events] == list(range(len(events)))
    await manager.close()


async def test_concurrent_cancels_end_the_session_once(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(100_000, delay=0.001), **callbacks)
    results = await asyncio.gather(*(manager.cancel("s1") for _ in range(5)))
    assert sorted(results) == [False] * 4 + [True]
    events = await asyncio.wait_for(drain(manager.listen("s1")), 5)
    assert sum(e.terminal for e in events) == 1
    await manager.close()


async def test_cancelling_an_orphaned_session_in_the_store_ends_it(
    sqlite_store, producer, callbacks, drain
) -> None:
    gate = asyncio.Event()

    async def stalls():
        async for emit in producer(3):
            yield emit
        await gate.wait()

    manager_a = SessionManager(sqlite_store, owner="A")
    session = await manager_a.start("s1", {}, stalls(), **callbacks)
    while session.last_index < 2:
        await asyncio.sleep(0.001)
    await manager_a.close()
    manager_b = SessionManager(sqlite_store, owner="B")
    assert await manager_b.cancel("s1")
    assert (await sqlite_store.get("s1")).state is SessionState.CANCELLED
    events = await drain(manager_b.listen("s1"))
    assert [e.index for e in events] == [0, 1, 2, 3] and events[-1].data == DONE
    await manager_b.close()


async def _state_at(session, seconds: float) -> SessionState:
    await asyncio.sleep(seconds)
    return session.state


async def test_session_without_listener_is_cancelled_after_the_delay_and_not_before(
    producer, callbacks, counter
) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0.2)
    work = producer(10**6, delay=0.002, counter=counter)
    session = await manager.start("s1", {}, work, **callbacks)
    assert await _state_at(session, 0.12) is SessionState.RUNNING
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.CANCELLED and counter.closed
    assert 0.2 <= session.finished_at - session.record.created_at < 1.0
    await manager.close()


async def test_a_listener_disarms_the_timer_and_leaving_rearms_it(producer, callbacks) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0.2)
    session = await manager.start("s1", {}, producer(10**6, delay=0.002), **callbacks)
    await asyncio.sleep(0.1)
    listener = manager.listen("s1")
    await anext(listener)  # attached at ~0.1 s
    assert await _state_at(session, 0.3) is SessionState.RUNNING  # 0.4 s: would have fired
    assert session.listeners == 1
    with contextlib.suppress(StopAsyncIteration):
        await listener.aclose()  # detach at ~0.4 s: re-armed
    assert session.listeners == 0
    assert await _state_at(session, 0.1) is SessionState.RUNNING
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.CANCELLED
    await manager.close()


async def test_zero_delay_never_auto_cancels(producer, callbacks) -> None:
    manager = SessionManager(MemoryStore(), cancel_after_disconnect=0)
    session = await manager.start("s1", {}, producer(60, delay=0.005), **callbacks)
    await asyncio.wait_for(session.wait(), 5)
    assert session.state is SessionState.FINISHED
    await manager.close()


async def test_close_stops_producers_without_recording_a_state(
    sqlite_store, producer, callbacks, counter
) -> None:
    manager = SessionManager(sqlite_store)
    await manager.start("s1", {}, producer(10**6, delay=0.001, counter=counter), **callbacks)
    await asyncio.sleep(0.02)
    await manager.close()
    assert counter.closed
    assert (await sqlite_store.get("s1")).state is SessionState.RUNNING  # resumable later
