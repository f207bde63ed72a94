"""Group commit (SQLite, Redis): many sessions' appends share transactions, each append still
durable when it returns, and one bad event fails only its own append."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis

from vlmserve.errors import InvalidRequest
from vlmserve.streaming import Event, RedisStore, SessionRecord, SessionState, SQLiteStore
from vlmserve.streaming.store.group import GroupCommit


def record(sid: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(sid, {"model": "m"}, SessionState.RUNNING, now, now)


@pytest.fixture(params=["sqlite", "redis"])
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        store: Any = SQLiteStore(tmp_path / "s.db")
    else:
        store = RedisStore(request.getfixturevalue("redis_url"), ttl=60, prefix=uuid.uuid4().hex)
    yield store
    with contextlib.suppress(Exception):  # the SQLite test closes its own
        await store.close()


async def test_concurrent_appends_share_transactions_and_all_are_stored(durable: Any) -> None:
    store = durable
    sessions = [f"s{i}" for i in range(8)]
    for sid in sessions:
        await store.create(record(sid))
    items, writes = store._appends.items, store._appends.writes  # SQLite counts its creates

    async def stream(sid: str) -> None:
        for i in range(20):
            await store.append(sid, Event(i, f"{sid}-{i}"))

    await asyncio.gather(*(stream(sid) for sid in sessions))
    assert store._appends.items - items == 160
    assert store._appends.writes - writes < 160 / 2  # events of several sessions per transaction
    for sid in sessions:
        events = await store.events(sid, -1)
        assert [e.data for e in events] == [f"{sid}-{i}" for i in range(20)]
        assert (await store.get(sid)).last_index == 19  # type: ignore[union-attr]


async def test_sqlite_group_commits_survive_a_reopen(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("s"))
    await asyncio.gather(*(store.append("s", Event(i, str(i))) for i in range(10)))
    await store.close()
    reopened = SQLiteStore(tmp_path / "s.db")  # committed, not just queued
    assert [e.data for e in await reopened.events("s", -1)] == [str(i) for i in range(10)]
    await reopened.close()


async def test_an_append_alone_is_written_at_once(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("a"))
    assert (store._appends.writes, store._appends.items) == (1, 1)  # the session's row
    await asyncio.wait_for(store.append("a", Event(0, "x")), timeout=5)
    assert (store._appends.writes, store._appends.items) == (2, 2)
    assert [e.data for e in await store.events("a", -1)] == ["x"]
    await store.close()


async def test_a_duplicate_event_fails_only_its_own_append(durable: Any) -> None:
    store = durable
    for sid in ("a", "b"):
        await store.create(record(sid))
    await store.append("a", Event(0, "first"))
    results = await asyncio.gather(
        store.append("a", Event(0, "again")),
        store.append("b", Event(0, "fine")),
        store.append("a", Event(1, "next")),
        return_exceptions=True,
    )
    assert isinstance(results[0], sqlite3.IntegrityError | redis.ResponseError)
    assert results[1:] == [None, None]
    assert [e.data for e in await store.events("a", -1)] == ["first", "next"]
    assert [e.data for e in await store.events("b", -1)] == ["fine"]


async def test_a_failed_write_fails_every_waiting_caller() -> None:
    async def broken(items: list[int]) -> list[BaseException | None]:
        raise OSError("disk gone")

    group: GroupCommit[int] = GroupCommit(broken)
    results = await asyncio.gather(*(group.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)


async def test_a_cancelled_caller_does_not_stop_the_batch() -> None:
    written: list[list[int]] = []
    gate = asyncio.Event()

    async def slow(items: list[int]) -> list[BaseException | None]:
        await gate.wait()
        written.append(items)
        return [None] * len(items)

    group: GroupCommit[int] = GroupCommit(slow)
    first = asyncio.ensure_future(group.submit(1))
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(group.submit(i)) for i in (2, 3)]
    await asyncio.sleep(0)
    queued[0].cancel()
    gate.set()
    await first
    await queued[1]
    with pytest.raises(asyncio.CancelledError):
        await queued[0]
    assert written == [[1], [2, 3]]  # the cancelled caller's item was still written


async def test_sqlite_sessions_created_at_once_share_a_transaction(tmp_path: Path) -> None:
    """A burst of new streams: their rows go out together; a taken id fails only its own."""
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("taken"))
    names = [f"n{i}" for i in range(8)] + ["taken"]
    results = await asyncio.gather(*(store.create(record(n)) for n in names),
                                   return_exceptions=True)  # fmt: skip
    assert results[:8] == [None] * 8
    assert isinstance(results[8], InvalidRequest) and "already exists" in str(results[8])
    assert store._appends.writes <= 3  # the first row alone, then the burst (and its retry)
    for name in names[:8]:
        assert (await store.get(name)).session_id == name  # type: ignore[union-attr]
    await store.close()
