"""SQLite's event journal: what a killed process left is replayed by the next store to open
the database, a live process's journal is left alone, a torn line ends a file's replay, and a
failed copy into the table loses nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vlmserve.streaming import Event, SessionRecord, SessionState, SQLiteStore
from vlmserve.streaming.store.sqlite import copy as sqlite_copy
from vlmserve.streaming.store.sqlite import store as sqlite_module
from vlmserve.streaming.store.sqlite.journal import read_rows

pytestmark = pytest.mark.timeout(60)

WRITER = textwrap.dedent(
    """
    import asyncio, sys, time
    from vlmserve.streaming import Event, SessionRecord, SessionState, SQLiteStore

    async def main():
        store = SQLiteStore(sys.argv[1])
        now = time.time()
        await store.create(SessionRecord("s", {}, SessionState.RUNNING, now, now))
        for i in range(int(sys.argv[2])):
            store.append_now("s", Event(i, f"e{i}"))
        if sys.argv[3:] == ["end"]:  # the session's end and a new owner, journaled too
            await store.heartbeat("s", "owner-b")
            store.append_now("s", Event(int(sys.argv[2]), "[DONE]", terminal=True))
            await store.set_state("s", SessionState.CANCELLED)
        print("written", flush=True)
        await asyncio.sleep(3600)  # killed before its copy into the table

    asyncio.run(main())
    """
)


def _record(sid: str = "s") -> SessionRecord:
    now = time.time()
    return SessionRecord(sid, {}, SessionState.RUNNING, now, now)


def _table_count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])


def _fail_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next copy into the table fails (a locked database); the ones after it work."""
    real = sqlite_copy.copy_entries
    failures = iter([sqlite3.OperationalError("database is locked")])

    def flaky(conn: sqlite3.Connection, rows: list, touch: list) -> None:  # type: ignore[type-arg]
        for exc in failures:
            raise exc
        real(conn, rows, touch)

    monkeypatch.setattr(sqlite_copy, "copy_entries", flaky)


async def test_a_killed_process_s_events_are_replayed_by_the_next_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "s.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), "500"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        journals = list(tmp_path.glob("s.db.events-*.jsonl"))
        assert len(journals) == 1 and len(read_rows(journals[0])) == 501  # the session, 500 events
        assert _table_count(db) == 0  # the copy waits for its interval: not yet in the table
        blocked = SQLiteStore(db)  # the writer is alive: its journal is not touched
        assert journals[0].exists() and await blocked.events("s", -1) == []
        await blocked.close()
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    with caplog.at_level(logging.INFO):
        store = SQLiteStore(db)
    assert f"replayed 501 journaled entries from {journals[0].name}" in caplog.text
    events = await store.events("s", -1)
    assert [(e.index, e.data) for e in events] == [(i, f"e{i}") for i in range(500)]
    assert not journals[0].exists()
    assert (await store.get("s")).last_index == 499  # type: ignore[union-attr]
    await store.close()


async def test_a_killed_process_s_state_change_and_owner_are_replayed(tmp_path: Path) -> None:
    """set_state and heartbeat are journaled like events: a ``kill -9`` before their copy
    into the table loses neither."""
    db = tmp_path / "s.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), "3", "end"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        with sqlite3.connect(db) as conn:  # not in the tables yet, the session's row neither
            assert conn.execute("SELECT state, owner FROM sessions").fetchall() == []
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    store = SQLiteStore(db)
    record = await store.get("s")
    assert record is not None and record.state is SessionState.CANCELLED
    assert record.owner == "owner-b" and record.last_index == 3
    assert [e.terminal for e in await store.events("s", -1)] == [False, False, False, True]
    await store.close()


async def test_a_state_change_reaches_the_table_without_a_read(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    await store.create(_record())
    await store.set_state("s", SessionState.FINISHED)
    await asyncio.sleep(sqlite_module._FLUSH_EVERY * 3)  # the timer's copy
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT state FROM sessions").fetchone() == ("finished",)
    await store.close()


_A, _B = '["s", 0, null, "a", null, 0]\n', '["s", 1, null, "b", null, 0]\n'
_FINISHED = '["s", "state", "finished", 1.0]\n'


@pytest.mark.parametrize(
    ("text", "data", "state"),
    [
        (_A + _B + '["s", 2, nu', ["a", "b"], SessionState.RUNNING),  # torn by a power cut
        # the second change names no state
        (_A + _FINISHED + '["s", "state", "exploded", 2.0]\n' + _B, ["a"], SessionState.FINISHED),
        # a new session whose alias is not a name
        (_A + '["s2", "{}", "running", 1.0, 1.0, -1, "", [7]]\n' + _B, ["a"], SessionState.RUNNING),
    ],
)
async def test_a_torn_or_corrupt_line_ends_the_replay_of_its_file(
    tmp_path: Path, caplog, text: str, data: list[str], state: SessionState
) -> None:
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    await store.create(_record())
    await store.close()
    left = tmp_path / "s.db.events-dead0000-1.jsonl"
    left.write_text(text)
    with caplog.at_level(logging.WARNING):
        reopened = SQLiteStore(db)
    assert [e.data for e in await reopened.events("s", -1)] == data
    assert (await reopened.get("s")).state is state  # type: ignore[union-attr]
    assert await reopened.get("s2") is None
    assert "is torn or corrupt; the rest is skipped" in caplog.text
    assert not left.exists()
    await reopened.close()


async def test_a_failed_copy_keeps_the_events_queued_and_their_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    store.append_now("s", Event(0, "a"))
    first = store._journal.current.path  # type: ignore[union-attr]
    _fail_once(monkeypatch)
    with pytest.raises(sqlite3.OperationalError):
        await store.events("s", -1)
    assert first.exists() and store.flushes == 0  # its only copy is still on disk
    store.append_now("s", Event(1, "b"))
    assert [e.data for e in await store.events("s", -1)] == ["a", "b"]
    assert not first.exists() and store.flushes == 1
    await store.close()


async def test_close_copies_everything_and_leaves_no_journal(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    for i in range(10):
        store.append_now("s", Event(i, str(i)))
    await store.close()
    assert _table_count(tmp_path / "s.db") == 10
    assert not list(tmp_path.glob("s.db.events-*"))


async def test_many_appends_are_copied_before_the_interval(tmp_path: Path) -> None:
    """A burst past ``_FLUSH_ROWS`` is copied at once: the queue in memory stays bounded."""
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    for i in range(sqlite_module._FLUSH_ROWS):
        store.append_now("s", Event(i, "x"))
    await asyncio.sleep(0.03)  # well under _FLUSH_EVERY
    assert store.flushes == 1 and not store._unflushed
    assert _table_count(tmp_path / "s.db") == sqlite_module._FLUSH_ROWS
    await store.close()


def test_an_in_memory_database_keeps_no_journal(tmp_path: Path) -> None:
    async def run() -> list[str]:
        store = SQLiteStore(":memory:")
        await store.create(_record())
        store.append_now("s", Event(0, "x"))
        data = [e.data for e in await store.events("s", -1)]
        await store.close()
        return data

    assert asyncio.run(run()) == ["x"]
    assert not list(Path.cwd().glob(":memory:.events-*"))


async def test_a_failed_background_copy_is_logged_and_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    _fail_once(monkeypatch)
    with caplog.at_level(logging.ERROR):
        store.append_now("s", Event(0, "a"))
        await asyncio.sleep(sqlite_module._FLUSH_EVERY * 3)  # the timer's copy fails
    assert "could not copy journaled events into" in caplog.text and store.flushes == 0
    for _ in range(100):  # tried again with no append to set a timer
        if store.flushes:
            break
        await asyncio.sleep(0.05)
    assert store.flushes == 1 and _table_count(tmp_path / "s.db") == 1
    await store.close()


def test_a_store_used_by_a_second_loop_copies_in_the_background(tmp_path: Path) -> None:
    """A timer set on a loop that has ended never fires: the next loop's append sets one."""
    store = SQLiteStore(tmp_path / "s.db")

    async def first() -> None:
        await store.create(_record())
        store.append_now("s", Event(0, "a"))  # its loop ends before the copy

    async def second() -> int:
        store.append_now("s", Event(1, "b"))
        await asyncio.sleep(sqlite_module._FLUSH_EVERY * 3)
        return _table_count(tmp_path / "s.db")

    asyncio.run(first())
    assert asyncio.run(second()) == 2
    asyncio.run(store.close())


async def test_close_after_a_failed_copy_keeps_the_journal_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(conn: sqlite3.Connection, rows: list, touch: list) -> None:  # type: ignore[type-arg]
        raise sqlite3.OperationalError("disk I/O error")

    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    store.append_now("s", Event(0, "kept"))
    monkeypatch.setattr(sqlite_copy, "copy_entries", broken)
    with pytest.raises(sqlite3.OperationalError):
        await store.close()
    monkeypatch.undo()
    reopened = SQLiteStore(tmp_path / "s.db")
    assert [e.data for e in await reopened.events("s", -1)] == ["kept"]
    await reopened.close()


async def test_appends_refresh_updated_at_at_most_once_a_second_and_at_the_end(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    record = _record()
    record.updated_at = record.created_at = time.time() - 100
    await store.create(record)
    store.append_now("s", Event(0, "a"))
    first = (await store.get("s")).updated_at  # type: ignore[union-attr]
    assert first > time.time() - 5  # the session's first event refreshed it
    store.append_now("s", Event(1, "b"))
    assert (await store.get("s")).updated_at == first  # type: ignore[union-attr]  # < 1 s later
    store.append_now("s", Event(2, "[DONE]", terminal=True))
    assert (await store.get("s")).updated_at > first  # type: ignore[union-attr]  # the end
    await store.close()


async def test_events_after_an_index_are_the_session_s_own_in_order(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    for sid in ("s", "t"):
        await store.create(_record(sid))
    for i in (2, 0, 1, 3):
        store.append_now("s", Event(i, f"s{i}"))
        store.append_now("t", Event(i, f"t{i}"))
    assert [(e.index, e.data) for e in await store.events("s", 1)] == [(2, "s2"), (3, "s3")]
    assert [e.data for e in await store.events("t", -1)] == ["t0", "t1", "t2", "t3"]
    assert await store.events("s", 3) == []
    await store.close()


async def test_journal_files_are_private_and_rotate_to_new_names(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    first = store._journal.current.path  # type: ignore[union-attr]
    assert first.stat().st_mode & 0o777 == 0o600  # events are users' text
    store.append_now("s", Event(0, "a"))
    await store.events("s", -1)  # a copy: the journal moves on to a new file
    second = store._journal.current.path  # type: ignore[union-attr]
    assert second != first and second.exists() and not first.exists()
    await store.close()
    assert not second.exists()


def test_a_corrupt_line_ends_its_file_s_replay(tmp_path: Path, caplog) -> None:
    left = tmp_path / "x.jsonl"
    left.write_text(
        '["s", 0, null, "a", null, 0]\n'
        '["s", "one", null, "b", null, 0]\n'
        '["s", 2, null, "c", null, 0]\n'
    )
    with caplog.at_level(logging.WARNING):
        assert read_rows(left) == [("s", 0, None, "a", None, 0)]
    assert "line 2 is torn or corrupt; the rest is skipped" in caplog.text
    assert read_rows(tmp_path / "gone.jsonl") == []


async def test_a_live_journal_is_passed_over_and_a_dead_one_after_it_replayed(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    live = SQLiteStore(db)  # its journal sorts first ("0...") and stays locked
    await live.create(_record())
    live._journal.current.path.rename(tmp_path / "s.db.events-000000000000-1.jsonl")  # type: ignore[union-attr]
    dead = tmp_path / "s.db.events-ffffffffffff-1.jsonl"
    dead.write_text('["s", 0, "error", "{}", "{\\"token_ids\\": [7]}", 1]\n')
    opened = SQLiteStore(db)
    assert await opened.events("s", -1) == [Event(0, "{}", "error", {"token_ids": [7]}, True)]
    assert not dead.exists() and (tmp_path / "s.db.events-000000000000-1.jsonl").exists()
    await opened.close()
    await live.close()


async def test_a_copy_larger_than_one_insert_keeps_every_event_and_touch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events go in as multi-row INSERTs of SQLite's parameter limit: a copy over it is split,
    and so are the sessions it touches, with nothing dropped."""
    monkeypatch.setattr(sqlite_copy, "_rows_per_insert", lambda conn: 2)  # 11 names a touch
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    sids = [f"s{i}" for i in range(13)]
    for sid in sids:
        await store.create(_record(sid))
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE sessions SET updated_at = 0")
    for sid in sids:
        store.append_now(sid, Event(0, sid))
    store.append_now("s0", Event(0, "again"))  # a duplicate index: the first one is kept
    store.append_now("s0", Event(1, "b"))
    assert [e.data for e in await store.events("s0", -1)] == ["s0", "b"]
    assert _table_count(db) == 14
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM sessions WHERE updated_at = 0").fetchone() == (0,)
    await store.close()


_GOOD_CREATE = ["s", "{}", "running", 1.0, 2.0, -1, "o", ["a1"]]


def _but(**changes: object) -> list[object]:
    fields = ["sid", "request", "state", "created", "updated", "last", "owner", "aliases"]
    return [changes.get(name, value) for name, value in zip(fields, _GOOD_CREATE, strict=True)]


@pytest.mark.parametrize(
    "bad",
    [
        [5, "state", "finished", 1.0],  # a session id that is not a string
        ["s", "owner", 5, 1.0],  # an owner that is not a string
        ["s", "colour", "red", 1.0],  # no such column
        ["s", "state", "finished", "noon"],  # no time
        _but(sid=5),
        _but(state="exploded"),
        _but(aliases="a1"),  # a string, not a list of names
        _but(aliases=[7]),
        _but(last="-1"),
        _but(created="then"),
        _but(updated=None),
    ],
)
def test_a_line_of_the_right_length_but_wrong_fields_ends_the_file(
    tmp_path: Path, bad: list[object]
) -> None:
    path = tmp_path / "j.jsonl"
    good = [["s", 0, None, "a", None, 0], ["s", "state", "finished", 1.5], _GOOD_CREATE]
    path.write_text("".join(json.dumps(line) + "\n" for line in [*good, bad, good[0]]))
    assert read_rows(path) == [
        ("s", 0, None, "a", None, 0),
        ("s", "state", "finished", 1.5),
        ("s", "{}", "running", 1.0, 2.0, -1, "o", ("a1",)),
    ]


async def test_a_new_session_whose_journal_write_fails_leaves_its_names_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    journal = store._journal
    assert journal is not None

    def full(entry: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "write", full)
    with pytest.raises(OSError, match="No space left"):
        await store.create(_record("s"))
    monkeypatch.undo()
    await store.create(_record("s"))  # the name was not kept by the failed attempt
    assert (await store.get("s")) is not None
    await store.close()


async def test_an_event_sqlite_could_not_store_fails_its_append_not_every_copy(
    tmp_path: Path,
) -> None:
    """A lone surrogate (not UTF-8) is refused at once; the journal and the copies go on."""
    store = SQLiteStore(tmp_path / "s.db")
    await store.create(_record())
    with pytest.raises(TypeError):  # orjson.JSONEncodeError
        store.append_now("s", Event(0, "\ud800"))
    store.append_now("s", Event(0, "ok"))
    assert [e.data for e in await store.events("s", -1)] == ["ok"]
    await store.close()
