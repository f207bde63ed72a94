"""Two server processes (two managers, two owners) sharing one real redis-server."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from vlmserve.streaming import DONE, Resumption, SessionManager, SessionState
from vlmserve.streaming.store.redis import RedisStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]

N = 60


@pytest.fixture
async def replicas(redis_url: str):
    """Stores of two replicas on the same Redis (same prefix), and their managers."""
    prefix = f"rep{uuid.uuid4().hex[:8]}"
    store_a, store_b = RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)
    a = SessionManager(store_a, owner="A", heartbeat_interval=0.05, stale_after=0.5)
    b = SessionManager(
        store_b, owner="B", heartbeat_interval=0.05, stale_after=0.5, follow_poll=0.1
    )
    yield a, b
    for manager in (a, b):
        await manager.close()
        await manager.store.close()


async def test_replica_b_follows_a_live_stream_of_replica_a_to_the_end(
    replicas, producer, callbacks, drain
) -> None:
    a, b = replicas
    await a.start("s1", {}, producer(N, delay=0.002), aliases=["chatcmpl-1"], **callbacks)
    first = await asyncio.wait_for(drain(a.listen("s1"), limit=10), 10)
    assert b.get("s1") is None  # not held by B: it must follow the store
    rest = await asyncio.wait_for(drain(b.listen("chatcmpl-1", after=9)), 10)
    events = first + rest
    assert [e.index for e in events] == list(range(N + 1))
    assert [json.loads(e.data)["i"] for e in events[:-1]] == list(range(N))
    assert events[-1].data == DONE and events[-1].meta is None
    assert events[5].meta == {"token": 5}


async def test_replica_b_replays_a_finished_session_of_replica_a(
    replicas, producer, callbacks, drain
) -> None:
    a, b = replicas
    session = await a.start("s1", {}, producer(N), **callbacks)
    await asyncio.wait_for(session.wait(), 10)
    events = await asyncio.wait_for(drain(b.listen("s1")), 10)
    assert [e.index for e in events] == list(range(N + 1))
    tail = await asyncio.wait_for(drain(b.listen("s1", after=N - 2)), 10)
    assert [e.data for e in tail] == [json.dumps({"i": N - 1}), DONE]


async def test_replica_b_cancels_a_stream_that_replica_a_produces(
    replicas, producer, callbacks, counter, drain
) -> None:
    a, b = replicas
    await a.start("s1", {}, producer(10_000, delay=0.002, counter=counter), **callbacks)
    await asyncio.sleep(0.05)
    assert await b.cancel("s1")
    await asyncio.wait_for(a.get("s1").wait(), 5)  # A notices at its next heartbeat
    assert a.get("s1").state is SessionState.CANCELLED and counter.closed
    events = await asyncio.wait_for(drain(b.listen("s1")), 10)
    assert json.loads(events[-2].data) == {"cancelled": True} and events[-1].data == DONE


async def test_replica_b_takes_over_when_replica_a_stops_heartbeating(
    replicas, producer, callbacks, drain
) -> None:
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


async def test_a_cancel_from_replica_b_reaches_replica_a_at_once_not_at_its_heartbeat(
    redis_url, producer, callbacks, counter
) -> None:
    prefix = f"rep{uuid.uuid4().hex[:8]}"
    a = SessionManager(RedisStore(redis_url, prefix=prefix), owner="A", heartbeat_interval=60)
    b = SessionManager(RedisStore(redis_url, prefix=prefix), owner="B", heartbeat_interval=60)
    try:
        await a.start("s1", {}, producer(100_000, delay=0.002, counter=counter), **callbacks)
        await asyncio.sleep(0.2)  # A has subscribed to the cancels
        assert await b.cancel("s1")
        await asyncio.wait_for(a.get("s1").wait(), 2)  # long before A's heartbeat at 60 s
        assert a.get("s1").state is SessionState.CANCELLED and counter.closed
    finally:
        for manager in (a, b):
            await manager.close()
            await manager.store.close()
