"""Which stores outlive the process, and what SQLite's journal leaves on disk: every event a
client was sent is in the files when the process dies, with no clean shutdown, and a store
that opens them has it."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from vlmserve.streaming import (
    Emit,
    Event,
    MemoryStore,
    SessionManager,
    SessionRecord,
    SessionState,
    SQLiteStore,
)

pytestmark = pytest.mark.timeout(30)


async def test_only_the_memory_store_is_not_durable(tmp_path: Path) -> None:
    assert SessionManager(MemoryStore()).durable is False
    store = SQLiteStore(tmp_path / "s.db")
    assert SessionManager(store).durable is True
    await store.close()


async def test_every_event_a_listener_got_is_in_the_file_before_close(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    manager = SessionManager(SQLiteStore(db), heartbeat_interval=0, gc_interval=0)
    gate = asyncio.Event()

    async def producer():  # type: ignore[no-untyped-def]
        for i in range(40):
            yield Emit(f"e{i}", meta={"token_ids": [i]})
        await gate.wait()  # still running when we look

    await manager.start("s", {}, producer(), on_cancel=lambda: [], on_error=lambda e: [])
    got = []
    async for event in manager.listen("s"):
        got.append(event)
        if len(got) == 40:
            break
    # The files as a process killed now leaves them (no close, no copy of the journal first),
    # opened by a new store, as a restarted server opens them.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for file in tmp_path.glob("s.db*"):
        shutil.copy(file, crashed / file.name)
    left = list(crashed.glob("s.db.events-*.jsonl"))
    assert left, "the events are still in the journal"
    reopened = SQLiteStore(crashed / "s.db")
    stored = [(e.index, e.data) for e in await reopened.events("s", -1)]
    assert [(e.index, e.data) for e in got] == stored[: len(got)]
    assert not any(file.exists() for file in left)  # replayed, then deleted
    with sqlite3.connect(crashed / "s.db") as conn:  # in the table itself, for any reader
        (count,) = conn.execute("SELECT COUNT(*) FROM events WHERE session_id = 's'").fetchone()
    assert count >= len(got)
    await reopened.close()
    gate.set()
    await manager.close()
    await manager.store.close()


async def test_many_grouped_appends_are_all_there_after_a_reopen(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    now = time.time()
    await store.create(SessionRecord("s", {}, SessionState.RUNNING, now, now))
    await asyncio.gather(*(store.append("s", Event(i, "x" * 200)) for i in range(2500)))
    await store.close()
    reopened = SQLiteStore(tmp_path / "s.db")
    assert len(await reopened.events("s", -1)) == 2500
    assert (await reopened.get("s")).last_index == 2499  # type: ignore[union-attr]
    await reopened.close()
