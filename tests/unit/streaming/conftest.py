"""Fixtures for the streaming tests: a real redis-server, stores, fake producers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlmserve.streaming import Emit, Event, MemoryStore, RedisStore, SessionStore, SQLiteStore


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_url, ttl=60, prefix=f"t{uuid.uuid4().hex[:8]}")
    yield store
    await store.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "streams.db", ttl=60)
    yield store
    await store.close()


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionStore]:
    """Each store kind in turn (redis skips when the binary is absent)."""
    store: SessionStore
    if request.param == "memory":
        store = MemoryStore(ttl=60)
    elif request.param == "sqlite":
        store = SQLiteStore(tmp_path / "streams.db", ttl=60)
    else:
        store = RedisStore(request.getfixturevalue("redis_url"), ttl=60, prefix=uuid.uuid4().hex)
    yield store
    await store.close()


@dataclass
class Counter:
    """What a fake producer did: how many emits it made, whether it was closed early."""

    produced: int = 0
    closed: bool = False


def numbered(
    n: int,
    *,
    delay: float = 0.0,
    start: int = 0,
    counter: Counter | None = None,
    fail_at: int | None = None,
    every: int = 1,
) -> AsyncIterator[Emit]:
    """Yields Emit(data='{"i": i}') for i in [start, n); sleeps ``delay`` every ``every`` items."""

    async def gen() -> AsyncIterator[Emit]:
        try:
            for i in range(start, n):
                if delay and i % every == 0:
                    await asyncio.sleep(delay)
                if i == fail_at:
                    raise RuntimeError(f"backend failed at {i}")
                if counter is not None:
                    counter.produced += 1
                yield Emit(json.dumps({"i": i}), meta={"token": i})
        except GeneratorExit:
            if counter is not None:
                counter.closed = True
            raise
        except asyncio.CancelledError:
            if counter is not None:
                counter.closed = True
            raise

    return gen()


@pytest.fixture
def producer() -> Callable[..., AsyncIterator[Emit]]:
    return numbered


def no_cancel_emits() -> list[Emit]:
    return [Emit(json.dumps({"cancelled": True}), meta={"finish_reason": "cancelled"})]


def error_emits(exc: BaseException) -> list[Emit]:
    return [Emit(json.dumps({"error": str(exc)}), event="error")]


@pytest.fixture
def callbacks() -> dict[str, Callable[..., list[Emit]]]:
    return {"on_cancel": no_cancel_emits, "on_error": error_emits}


async def collect(listener: AsyncIterator[Event], limit: int | None = None) -> list[Event]:
    """Events until the listener ends, or the first ``limit`` ones; closes the listener."""
    out: list[Event] = []
    try:
        async for event in listener:
            out.append(event)
            if limit is not None and len(out) >= limit:
                break
    finally:
        await listener.aclose()  # type: ignore[attr-defined]
    return out


@pytest.fixture
def drain() -> Callable[..., object]:
    return collect


@pytest.fixture
def counter() -> Counter:
    return Counter()
