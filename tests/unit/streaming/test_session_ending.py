"""How a Session ends: failures of the producer, the store or a callback; cancel; close."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from session_fakes import RecordingStore, stalled, started, wait_until

from vlmserve.streaming import DONE, Emit, MemoryStore, SessionManager, SessionRecord, SessionState
from vlmserve.streaming.session import Session, SessionOptions

pytestmark = pytest.mark.timeout(30)


# -- ending -----------------------------------------------------------------------------------


async def test_finish_records_when_it_ended_even_if_the_store_fails(caplog) -> None:
    store = RecordingStore()
    store.fail.add("set_state")
    session, gate = await started(store, heartbeat_interval=0)
    gate.set()
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.FINISHED  # held here although the store failed
    assert session.finished_at is not None and abs(session.finished_at - time.time()) < 1
    assert "session s1: could not persist its end (SessionState.FINISHED)" in caplog.messages


async def test_a_failing_on_error_still_ends_with_an_internal_error_event(producer, caplog) -> None:
    def broken(exc: BaseException) -> list[Emit]:
        raise ValueError("bug in on_error")

    manager = SessionManager(MemoryStore())
    session = await manager.start(
        "s1", {}, producer(10, fail_at=2), on_cancel=list, on_error=broken
    )
    await asyncio.wait_for(session.wait(), 2)
    events = [e async for e in session.stream(-1)]
    assert [e.index for e in events] == [0, 1, 2, 3]
    assert events[2].event == "error"
    error = json.loads(events[2].data)["error"]
    assert (error["message"], error["code"]) == ("generation failed", "internal_error")
    assert session.state is SessionState.FAILED
    assert "session s1: on_error failed" in caplog.messages
    await manager.close()


async def test_a_failing_on_cancel_still_ends_the_cancelled_stream_with_done(caplog) -> None:
    def broken() -> list[Emit]:
        raise ValueError("bug in on_cancel")

    manager = SessionManager(MemoryStore())
    _, gen = stalled(2)
    session = await manager.start("s1", {}, gen, on_cancel=broken, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 1)
    assert await session.cancel()
    events = [e async for e in session.stream(-1)]
    assert [e.data for e in events][-1] == DONE and len(events) == 3
    assert session.state is SessionState.CANCELLED
    assert "session s1: on_cancel failed" in caplog.messages
    await manager.close()


async def test_a_producer_without_aclose_can_be_cancelled() -> None:
    class Plain:
        """An async iterator that is not a generator (no aclose)."""

        def __aiter__(self) -> Plain:
            return self

        async def __anext__(self) -> Emit:
            await asyncio.sleep(0.002)
            return Emit("{}")

    manager = SessionManager(MemoryStore())
    session = await manager.start("s1", {}, Plain(), on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index >= 2)
    assert await session.cancel()
    assert session.state is SessionState.CANCELLED
    assert not await session.cancel()  # already ended
    await manager.close()


async def test_close_while_a_cancel_runs_waits_for_it() -> None:
    manager = SessionManager(MemoryStore())
    _, gen = stalled(2)
    session = await manager.start("s1", {}, gen, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 1)
    cancelling = asyncio.ensure_future(session.cancel())
    await asyncio.sleep(0)
    await session.close()
    assert session.state is SessionState.CANCELLED and not session.running
    assert await cancelling
    await manager.close()


# -- failures of the store and the callbacks ---------------------------------------------------


async def test_when_the_store_cannot_append_the_session_still_ends_as_failed(caplog) -> None:
    store = RecordingStore()
    manager = SessionManager(store, heartbeat_interval=0)
    store.fail.add("append")
    _, gen = stalled(3)
    session = await manager.start("s1", {}, gen, on_cancel=list, on_error=lambda exc: [])
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.FAILED and session.last_index == -1
    assert session.finished_at is not None and abs(session.finished_at - time.time()) < 1
    assert "session s1: could not persist its end (SessionState.FAILED)" in caplog.messages
    await manager.close()


async def test_finished_at_is_when_done_was_published(producer, callbacks) -> None:
    manager = SessionManager(MemoryStore())
    before = time.time()
    session = await manager.start("s1", {}, producer(5), **callbacks)
    await asyncio.wait_for(session.wait(), 2)
    assert before <= session.record.updated_at <= time.time()
    assert session.finished_at == session.record.updated_at
    await manager.close()


async def test_a_producer_failure_is_logged_with_the_exception(producer, callbacks, caplog) -> None:
    manager = SessionManager(MemoryStore())
    session = await manager.start("s1", {}, producer(10, fail_at=2), **callbacks)
    await asyncio.wait_for(session.wait(), 2)
    assert "session s1: producer failed: RuntimeError('backend failed at 2')" in caplog.messages
    await manager.close()


async def test_without_callbacks_a_failure_or_cancel_ends_with_done_alone(producer, caplog) -> None:
    now = time.time()
    for fail_at, state in ((2, SessionState.FAILED), (None, SessionState.CANCELLED)):
        record = SessionRecord("s1", {}, SessionState.RUNNING, now, now)
        store = MemoryStore()
        await store.create(record)
        session = Session(record, store, SessionOptions(heartbeat_interval=0))
        work = producer(10**6, delay=0.002, fail_at=fail_at)
        session.start(work, None, None)  # type: ignore[arg-type]
        await wait_until(lambda s=session: s.last_index >= 1)
        if fail_at is None:
            assert await session.cancel()
        await asyncio.wait_for(session.wait(), 2)
        events = [e async for e in session.stream(-1)]
        assert events[-1].data == DONE and events[-2].event is None, state
        assert session.state is state
        await session.close()
    assert not [m for m in caplog.messages if m.endswith(("on_error failed", "on_cancel failed"))]


async def test_a_producer_whose_aclose_fails_is_still_cancelled(caplog) -> None:
    class Stubborn:
        def __aiter__(self) -> Stubborn:
            return self

        async def __anext__(self) -> Emit:
            await asyncio.sleep(0.002)
            return Emit("{}")

        async def aclose(self) -> None:
            raise RuntimeError("cannot close")

    manager = SessionManager(MemoryStore())
    session = await manager.start("s1", {}, Stubborn(), on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index >= 1)
    assert await session.cancel()
    assert session.state is SessionState.CANCELLED
    assert "session s1: closing the producer failed" in caplog.messages
    await manager.close()


# -- close --------------------------------------------------------------------------------------


async def test_close_stops_a_running_producer_and_keeps_the_session_resumable(
    producer, counter
) -> None:
    store = MemoryStore()
    manager = SessionManager(store)
    work = producer(10**6, delay=0.001, counter=counter)
    session = await manager.start("s1", {}, work, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index >= 3)
    await session.close()
    produced = counter.produced
    await asyncio.sleep(0.05)
    assert counter.closed and counter.produced == produced  # stopped, not left running
    assert session.state is SessionState.RUNNING and not session.running
    assert (await store.get("s1")).state is SessionState.RUNNING
    await manager.close()


async def test_a_cancel_that_arrives_during_shutdown_leaves_the_session_resumable() -> None:
    store = MemoryStore()
    manager = SessionManager(store)
    _, gen = stalled(2)
    session = await manager.start("s1", {}, gen, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 1)
    closing = asyncio.ensure_future(session.close())
    await asyncio.sleep(0)  # close() has begun
    assert not await session.cancel()
    await closing
    assert session.state is SessionState.RUNNING
    assert (await store.get("s1")).state is SessionState.RUNNING
    await manager.close()


class IgnoresCancel:
    """A producer stuck in ``__anext__`` that swallows cancellation until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent = False

    def __aiter__(self) -> IgnoresCancel:
        return self

    async def __anext__(self) -> Emit:
        if not self.sent:
            self.sent = True
            return Emit("{}")
        while not self.release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue
        raise StopAsyncIteration


async def test_close_gives_up_after_its_timeout_on_a_producer_that_ignores_cancel() -> None:
    manager = SessionManager(MemoryStore(), heartbeat_interval=0)
    work = IgnoresCancel()
    session = await manager.start("s1", {}, work, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 0)
    started_at = time.monotonic()
    await session.close(timeout=0.1)
    assert time.monotonic() - started_at < 1
    work.release.set()
    await manager.close()


async def test_close_gives_up_after_its_timeout_on_a_cancel_that_cannot_finish() -> None:
    manager = SessionManager(MemoryStore(), heartbeat_interval=0)
    work = IgnoresCancel()
    session = await manager.start("s1", {}, work, on_cancel=list, on_error=lambda exc: [])
    await wait_until(lambda: session.last_index == 0)
    cancelling = asyncio.ensure_future(session.cancel())
    await asyncio.sleep(0.02)
    started_at = time.monotonic()
    await session.close(timeout=0.1)
    assert time.monotonic() - started_at < 1
    work.release.set()
    assert await asyncio.wait_for(cancelling, 2)
    await manager.close()


async def test_a_cancel_during_the_clean_up_after_a_failure_is_refused() -> None:
    class FailsThenClosesSlowly:
        def __init__(self) -> None:
            self.closing = asyncio.Event()

        def __aiter__(self) -> FailsThenClosesSlowly:
            return self

        async def __anext__(self) -> Emit:
            raise RuntimeError("backend failed")

        async def aclose(self) -> None:
            self.closing.set()
            await asyncio.sleep(0.05)

    manager = SessionManager(MemoryStore())
    work = FailsThenClosesSlowly()
    session = await manager.start("s1", {}, work, on_cancel=list, on_error=lambda exc: [])
    await asyncio.wait_for(work.closing.wait(), 2)
    assert not await session.cancel()  # the session is already ending
    await asyncio.wait_for(session.wait(), 2)
    assert session.state is SessionState.FAILED
    events = [e async for e in session.stream(-1)]
    assert [e.data for e in events] == [DONE]
    await manager.close()
