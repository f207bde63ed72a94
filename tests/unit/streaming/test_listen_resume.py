"""Listening and resuming: every event exactly once, in order, ending with [DONE]."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest

from vlmserve.errors import InvalidRequest, NotFound
from vlmserve.streaming import DONE, Event, MemoryStore, SessionManager, SessionState

pytestmark = pytest.mark.timeout(30)

N = 40


def check_complete(events: list[Event], n: int = N) -> None:
    assert [e.index for e in events] == list(range(n + 1))  # strictly increasing, no gap
    assert [json.loads(e.data)["i"] for e in events[:-1]] == list(range(n))
    assert events[-1].data == DONE and events[-1].terminal
    assert not any(e.terminal for e in events[:-1])


async def test_listen_from_the_start_gets_every_event_then_done(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {"q": 1}, producer(N, delay=0.001, every=5), **callbacks)
    events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
    check_complete(events)
    assert events[3].meta == {"token": 3}
    assert manager.get("s1").state is SessionState.FINISHED
    await asyncio.wait_for(manager.get("s1").wait(), 5)  # the store's state is set after [DONE]
    assert (await any_store.get("s1")).state is SessionState.FINISHED
    await manager.close()


async def test_generation_runs_to_the_end_without_listeners(any_store, producer, callbacks) -> None:
    manager = SessionManager(any_store)
    session = await manager.start("s1", {}, producer(N, delay=0.001, every=10), **callbacks)
    await asyncio.wait_for(session.wait(), 10)
    assert session.state is SessionState.FINISHED
    assert session.last_index == N  # N events + [DONE]
    await manager.close()


async def test_resume_after_any_disconnect_point_loses_and_repeats_nothing(
    any_store, producer, callbacks, drain
) -> None:
    rng = random.Random(1234)
    manager = SessionManager(any_store)
    for trial in range(32):
        sid = f"r{trial}"
        await manager.start(sid, {}, producer(N, delay=0.001, every=7), **callbacks)
        k = rng.randint(1, N + 1)  # 1 .. every event including [DONE]
        first = await asyncio.wait_for(drain(manager.listen(sid), limit=k), 10)
        rest = await asyncio.wait_for(drain(manager.listen(sid, after=k - 1)), 10)
        assert len(first) == k
        check_complete(first + rest)
    await manager.close()


async def test_two_concurrent_listeners_see_identical_sequences(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(N, delay=0.001), **callbacks)
    a, b = await asyncio.wait_for(
        asyncio.gather(drain(manager.listen("s1")), drain(manager.listen("s1"))), 10
    )
    check_complete(a)
    assert a == b
    await manager.close()


async def test_resuming_a_finished_session_replays_the_tail_and_ends_with_done(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    session = await manager.start("s1", {}, producer(N), **callbacks)
    await asyncio.wait_for(session.wait(), 10)
    tail = await asyncio.wait_for(drain(manager.listen("s1", after=N - 3)), 10)
    assert [e.index for e in tail] == [N - 2, N - 1, N]
    assert tail[-1].data == DONE
    assert await drain(manager.listen("s1", after=N)) == []  # the client already had [DONE]
    await manager.close()


async def test_listen_by_alias(any_store, producer, callbacks, drain) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(5), aliases=["chatcmpl-1"], **callbacks)
    events = await asyncio.wait_for(drain(manager.listen("chatcmpl-1")), 10)
    check_complete(events, 5)
    await manager.close()


async def test_unknown_session_raises_not_found_before_any_event(any_store) -> None:
    manager = SessionManager(any_store)
    listener = manager.listen("nope")
    with pytest.raises(NotFound):
        await listener  # awaiting resolves the session first (what the API does for a 404)
    with pytest.raises(NotFound):
        await anext(manager.listen(uuid.uuid4().hex))
    await manager.close()


@pytest.mark.parametrize(("sid", "after"), [("bad id", -1), ("s1", -2), ("s1", "3")])
async def test_malformed_listen_arguments_raise_invalid_request(sid, after) -> None:
    manager = SessionManager(MemoryStore())
    with pytest.raises(InvalidRequest):
        manager.listen(sid, after)


async def test_starting_an_existing_session_id_raises_invalid_request(
    any_store, producer, callbacks
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(3), aliases=["a1"], **callbacks)
    for sid, aliases in (("s1", ()), ("s2", ["a1"]), ("a1", ())):
        with pytest.raises(InvalidRequest, match="already exists"):
            await manager.start(sid, {}, producer(3), aliases=aliases, **callbacks)
    assert await manager.exists("a1") and not await manager.exists("s2")
    await manager.close()


async def test_producer_exception_appends_on_error_emits_then_done(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    await manager.start("s1", {}, producer(N, fail_at=5), **callbacks)
    events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
    assert [e.index for e in events] == list(range(7))
    assert events[5].event == "error" and "backend failed at 5" in events[5].data
    assert events[6].data == DONE
    await asyncio.wait_for(manager.get("s1").wait(), 5)
    assert (await any_store.get("s1")).state is SessionState.FAILED
    await manager.close()


async def test_expired_sessions_are_forgotten_by_id_and_alias_and_the_alias_is_free_again(
    producer, callbacks
) -> None:
    manager = SessionManager(MemoryStore(ttl=10), ttl=10, gc_interval=0)
    session = await manager.start("s1", {}, producer(3), aliases=["chatcmpl-1"], **callbacks)
    await asyncio.wait_for(session.wait(), 5)
    assert await manager.gc(now=time.time()) == 0  # ended just now: kept
    assert await manager.gc(now=time.time() + 11) == 2  # here and in the store
    assert manager.get("s1") is None and manager.get("chatcmpl-1") is None
    for name in ("s1", "chatcmpl-1"):
        with pytest.raises(NotFound):
            await manager.listen(name)
    await manager.start("s2", {}, producer(3), aliases=["chatcmpl-1"], **callbacks)
    assert manager.get("chatcmpl-1").session_id == "s2"
    await manager.close()
