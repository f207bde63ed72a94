"""Group commit: many sessions' appends share transactions (Redis's appends, SQLite's copies of
its journal and its new sessions), each append still durable when it returns, and one bad
event or session fails only its own caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from vlmserve.streaming.store.sqlite.journal import read_rows


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
    writes = _transactions(store)

    async def stream(sid: str) -> None:
        for i in range(20):
            await store.append(sid, Event(i, f"{sid}-{i}"))

    await asyncio.gather(*(stream(sid) for sid in sessions))
    if isinstance(store, RedisStore):
        assert store._appends.items == 160
    events = [await store.events(sid, -1) for sid in sessions]  # SQLite copies its journal
    assert _transactions(store) - writes < 160 / 2  # events of several sessions per transaction
    for sid, stored in zip(sessions, events, strict=True):
        assert [e.data for e in stored] == [f"{sid}-{i}" for i in range(20)]
    for sid in sessions:
        assert (await store.get(sid)).last_index == 19  # type: ignore[union-attr]


def _transactions(store: Any) -> int:
    """Transactions that carried events: Redis's pipelines, SQLite's copies of its journal."""
    return store.flushes if isinstance(store, SQLiteStore) else store._appends.writes


async def test_sqlite_group_commits_survive_a_reopen(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("s"))
    await asyncio.gather(*(store.append("s", Event(i, str(i))) for i in range(10)))
    await store.close()
    reopened = SQLiteStore(tmp_path / "s.db")  # committed, not just queued
    assert [e.data for e in await reopened.events("s", -1)] == [str(i) for i in range(10)]
    await reopened.close()


async def test_an_append_alone_is_in_the_journal_at_once_and_read_back(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("a"))
    assert (store._name_checks.writes, store._name_checks.items) == (1, 1)  # its names
    store.append_now("a", Event(0, "x"))
    created, appended = read_rows(store._journal.current.path)
    assert created[0] == "a" and json.loads(created[1]) == record("a").request
    assert appended == ("a", 0, None, "x", None, 0)
    assert [e.data for e in await store.events("a", -1)] == ["x"]  # copied for the read
    assert store.flushes == 1
    assert not list(tmp_path.glob("s.db.events-*-1.jsonl"))  # the copied file is deleted
    await store.close()


async def test_the_journal_is_copied_in_the_background(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("a"))
    for i in range(3):
        store.append_now("a", Event(i, "x"))
    with sqlite3.connect(tmp_path / "s.db") as conn:  # a reader of the file alone
        count = "SELECT COUNT(*) FROM events"
        assert conn.execute(count).fetchone() == (0,)
        for _ in range(100):
            if conn.execute(count).fetchone() == (3,):
                break
            await asyncio.sleep(0.02)
        assert conn.execute(count).fetchone() == (3,)
    assert store.flushes == 1
    await store.close()


async def test_sqlite_keeps_the_first_of_two_events_with_one_index(tmp_path: Path) -> None:
    """A journal replayed twice (a crash between a copy and the file's deletion)."""
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(record("a"))
    await store.append("a", Event(0, "first"))
    assert [e.data for e in await store.events("a", -1)] == ["first"]
    await store.append("a", Event(0, "again"))
    await store.append("a", Event(1, "next"))
    assert [e.data for e in await store.events("a", -1)] == ["first", "next"]
    await store.close()


async def test_a_duplicate_redis_event_fails_only_its_own_append(redis_url: str) -> None:
    store = RedisStore(redis_url, ttl=60, prefix=uuid.uuid4().hex)
    for sid in ("a", "b"):
        await store.create(record(sid))
    await store.append("a", Event(0, "first"))
    results = await asyncio.gather(
        store.append("a", Event(0, "again")),
        store.append("b", Event(0, "fine")),
        store.append("a", Event(1, "next")),
        return_exceptions=True,
    )
    assert isinstance(results[0], redis.ResponseError)
    assert results[1:] == [None, None]
    assert [e.data for e in await store.events("a", -1)] == ["first", "next"]
    assert [e.data for e in await store.events("b", -1)] == ["fine"]
    await store.close()


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
    results = await asyncio.gather(
        *(store.create(record(n)) for n in names), return_exceptions=True
    )
    assert results[:8] == [None] * 8
    assert isinstance(results[8], InvalidRequest) and "already exists" in str(results[8])
    assert store._name_checks.writes <= 3  # the first row alone, then the burst (and its retry)
    for name in names[:8]:
        assert (await store.get(name)).session_id == name  # type: ignore[union-attr]
    await store.close()
