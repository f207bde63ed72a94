"""A durable session's events: published only once committed, and without a task each."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

import pytest
from session_fakes import stalled

from vlmserve.streaming import DONE, Event, SessionManager, SessionState, SQLiteStore
from vlmserve.streaming.events import Emit, SessionRecord
from vlmserve.streaming.publisher import Publisher

pytestmark = pytest.mark.timeout(30)


class FailsAt(SQLiteStore):
    """SQLite whose journal write of event ``bad`` fails (a full disk); the others go in."""

    def __init__(self, path: Path, bad: int) -> None:
        super().__init__(path, ttl=60)
        self.bad = bad

    def append_now(self, session_id: str, event: Event) -> None:
        if event.index == self.bad:
            raise OSError(28, "No space left on device (the journal's disk is full)")
        super().append_now(session_id, event)


@pytest.mark.parametrize("waiting", [False, True], ids=["producing", "producer-waiting"])
async def test_an_event_whose_commit_failed_is_never_sent_and_the_stream_ends_failed(
    tmp_path: Path, producer, callbacks, drain, waiting: bool
) -> None:
    """Listeners never see the event the store lost; the session ends with the error event,
    also when the producer was waiting for its next chunk (nothing else would end it)."""
    store = FailsAt(tmp_path / "s.db", bad=5)
    manager = SessionManager(store)
    chunks = stalled(6)[1] if waiting else producer(40)
    session = await manager.start("s1", {}, chunks, **callbacks)
    events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
    sent = [json.loads(e.data).get("i") for e in events if e.data != DONE]
    assert sent[:-1] == [0, 1, 2, 3, 4]  # nothing after the lost event 5 but the ending
    assert [e.index for e in events] == sorted({e.index for e in events})
    resumed = await asyncio.wait_for(drain(manager.listen("s1", after=3)), 10)
    assert [e.index for e in resumed] == [4] + [e.index for e in events[-2:]]
    assert events[-2].event == "error" and "No space left" in events[-2].data
    assert events[-1].data == DONE
    await asyncio.wait_for(session.wait(), 5)
    assert session.state is SessionState.FAILED
    stored = [e.index for e in await store.events("s1", -1)]
    assert 5 not in stored and stored[:5] == [0, 1, 2, 3, 4]
    await manager.close()


async def test_a_sqlite_session_makes_no_task_per_event(
    sqlite_store: SQLiteStore, producer, callbacks, drain
) -> None:
    """Tasks: the producer's, the heartbeat's and one per copy into the table, not one per
    event."""
    loop = asyncio.get_running_loop()
    made = 0

    def counting(loop: asyncio.AbstractEventLoop, coro, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal made
        made += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        manager = SessionManager(sqlite_store)
        session = await manager.start("s1", {}, producer(200), **callbacks)
        events = await asyncio.wait_for(drain(manager.listen("s1")), 10)
        await asyncio.wait_for(session.wait(), 5)
    finally:
        loop.set_task_factory(None)
    assert len(events) == 201
    copies = sqlite_store.flushes
    assert copies < 20  # journaled events reach the table many at a time
    assert made <= copies + 10, f"{made} tasks for 201 events in {copies} copies"
    assert [e.index for e in await sqlite_store.events("s1", -1)] == list(range(201))
    await manager.close()


class Deferred:
    """A store whose appends finish when the test says (``append_nowait``'s futures)."""

    def __init__(self) -> None:
        self.commits: dict[int, asyncio.Future[None]] = {}

    def append_nowait(self, session_id: str, event: Event) -> asyncio.Future[None]:
        self.commits[event.index] = asyncio.get_running_loop().create_future()
        return self.commits[event.index]


async def test_after_a_lost_commit_the_producers_next_event_is_refused_not_published() -> None:
    """The lost commit's callbacks can run before the session has stopped its producer (the
    stop comes one callback later): an event issued in between must not reach listeners,
    or they would read the text with event 5 missing from its middle."""
    store = Deferred()
    record = SessionRecord("s1", {}, SessionState.RUNNING, 0.0, 0.0)
    lost: list[BaseException] = []
    publisher = Publisher(record, store, deque(), lost.append)  # type: ignore[arg-type]
    for i in range(7):
        await publisher.commit(Emit(json.dumps({"i": i})))
    for index, commit in store.commits.items():
        if index == 5:
            commit.set_exception(OSError(28, "No space left on device"))
        else:
            commit.set_result(None)
    await asyncio.sleep(0)  # the commits' callbacks run
    assert record.last_index == 4 and len(lost) == 1
    with pytest.raises(OSError, match="No space left"):
        await publisher.commit(Emit(json.dumps({"i": 7})))
    assert 7 not in store.commits and [e.index for e in publisher.ring] == [0, 1, 2, 3, 4]
    publisher.ending = True  # the session's error event and [DONE] still go out
    await publisher.commit(Emit("failed", "error"))
    store.commits[max(store.commits)].set_result(None)
    await asyncio.sleep(0)
    assert [e.data for e in publisher.ring][-1] == "failed"
