"""One resumable session: producer task, ring buffer, listeners, disconnect timer, heartbeat.

The producer task numbers each ``Emit``, appends the event to the store (durable), then to the
ring buffer, then wakes listeners; so anything a listener sees in the ring is also in the store.
A store whose ``append_now`` is done when it returns (memory, SQLite's journal): the event is
published inline, no task or future per event. One that commits later (Redis): up to
``_IN_FLIGHT`` events are on their way at once (group-committed, in order), each published
from its commit's done callback; the terminal event waits for all. Events that come before a
new durable session's row is committed wait for it (``rowgate.py``). Generation never waits
for listeners. When the last listener leaves, a timer of ``cancel_after_disconnect`` seconds
is armed; a new listener disarms it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from vlmserve.streaming.events import (
    DONE,
    FINAL_STATES,
    Emit,
    Event,
    OnCancel,
    OnError,
    SessionRecord,
    SessionState,
    error_emit,
    gap_event,
    ring_tail,
)
from vlmserve.streaming.rowgate import RowGate
from vlmserve.streaming.signal import Signal
from vlmserve.streaming.store.base import AppendNow, SessionStore, store_event

__all__ = ["Session", "SessionOptions"]

logger = logging.getLogger(__name__)
_IN_FLIGHT = 16  # events of one session being committed at once


@dataclass(slots=True)
class SessionOptions:
    ring_size: int = 2048
    cancel_after_disconnect: float = 3600.0  # 0 = never cancel when listeners are gone
    heartbeat_interval: float = 2.0  # 0 = no heartbeats


@dataclass(slots=True, eq=False)
class Session:
    record: SessionRecord
    store: SessionStore
    options: SessionOptions = field(default_factory=SessionOptions)
    listeners: int = 0
    finished_at: float | None = None  # time.time() when the terminal event was published
    ring: deque[Event] = field(init=False)
    _changed: Signal = field(default_factory=Signal)  # an event published, or the end
    _producer: AsyncIterator[Emit] | None = None
    _on_cancel: OnCancel | None = None
    _on_error: OnError | None = None
    _task: asyncio.Task[None] | None = None
    _cancel_task: asyncio.Task[None] | None = None
    _heartbeat: asyncio.Task[None] | None = None
    _timer: asyncio.TimerHandle | None = None
    _pending: deque[asyncio.Future[None]] = field(default_factory=deque)  # commits in flight
    _issued: int | None = None  # the last index handed out (None: record.last_index)
    _store_error: BaseException | None = None  # a commit that failed in the background
    _lost: tuple[int, int] | None = None  # a failed commit's index .. the last one issued then
    _finishing: bool = False  # the end (normal, cancel or error) has begun
    _ended: bool = False  # terminal published, or stopped for good without one (shutdown)
    _append_now: AppendNow | None = None  # the store's append done when it returns: inline
    _gate: RowGate | None = None  # a new durable session: its events follow its row

    def __post_init__(self) -> None:
        self.ring = deque(maxlen=max(1, self.options.ring_size))
        self._append_now = getattr(self.store, "append_now", None)

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def state(self) -> SessionState:
        return self.record.state

    @property
    def last_index(self) -> int:
        return self.record.last_index

    @property
    def done(self) -> bool:
        return self.record.state in FINAL_STATES

    @property
    def running(self) -> bool:
        return not self._finishing and not self._ended and self._task is not None

    def seed(self, events: list[Event]) -> None:
        """Fill the ring with already persisted events (a session taken over after a restart)."""
        self.ring.extend(events)  # a deque with maxlen keeps the newest
        if events:
            self.record.last_index = events[-1].index

    def start(
        self,
        producer: AsyncIterator[Emit],
        on_cancel: OnCancel,
        on_error: OnError,
        created: asyncio.Future[None] | None = None,
    ) -> None:
        """Run ``producer`` as a task; numbering continues at ``last_index + 1``. ``created``:
        the store's commit of this session's row, which every event waits for."""
        self._producer, self._on_cancel, self._on_error = producer, on_cancel, on_error
        if created is not None:
            self._gate = RowGate(created, self._begin)
        self._task = asyncio.ensure_future(self._run())
        if self.options.heartbeat_interval > 0:
            self._heartbeat = asyncio.ensure_future(self._beat())
        if self.listeners == 0:
            self._arm()

    async def _run(self) -> None:
        assert self._producer is not None
        try:
            async for emit in self._producer:
                await self._commit(emit)
        except asyncio.CancelledError:
            if self._store_error is None or self._finishing:
                raise  # cancel() or close() goes on from here
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()
            await self._fail(self._store_error)  # a commit failed while the producer waited
        except Exception as exc:
            await self._fail(exc)
        else:
            if not self._finishing:
                self._finishing = True
                await self.finish([], SessionState.FINISHED)

    async def _fail(self, exc: BaseException) -> None:
        if not self._finishing:
            self._finishing = True
            await self._settle()
            await self.finish(self._error_emits(exc), SessionState.FAILED)

    def _published(self, future: asyncio.Future[None]) -> None:
        """A commit failed while the producer was elsewhere (waiting for its next chunk):
        stop the producer, so the session ends as failed instead of waiting forever."""
        if future.cancelled() or future.exception() is None or self._store_error is not None:
            return
        self._store_error = future.exception()
        if self._task is not None and not self._task.done() and not self._finishing:
            self._task.cancel()

    async def _commit(self, emit: Emit, final: SessionState | None = None) -> None:
        """Number ``emit`` and send it to the store; wait only when ``_IN_FLIGHT`` commits
        are under way, or for every one of them when the event is the terminal one."""
        index = (self.record.last_index if self._issued is None else self._issued) + 1
        self._issued = index
        event = Event(index, emit.data, emit.event, emit.meta, terminal=final is not None)
        if self._inline(index):  # nothing to wait for
            self._pending.clear()  # all done: every earlier event is published
            self._append_now(self.session_id, event)  # type: ignore[misc]
            self._publish(event, final)
            await asyncio.sleep(0)  # listeners read before the next event, as below
            return
        publishing = self._start_publish(event, final)
        if final is None:
            publishing.add_done_callback(self._published)
        self._pending.append(publishing)
        await asyncio.sleep(0)  # let the commit start and listeners read, as before
        while self._pending and (final is not None or len(self._pending) >= _IN_FLIGHT):
            # Shielded: a cancel must not leave it unknown whether the store got the event.
            await asyncio.shield(self._pending[0])
            self._pending.popleft()

    def _inline(self, index: int) -> bool:
        """Whether event ``index`` can be appended and published at once: the store's append
        is done when it returns, the session's row is in, and every earlier event is out."""
        gate_open = self._gate is None or self._gate.open
        return self._append_now is not None and self.record.last_index == index - 1 and gate_open

    async def _drain(self) -> None:
        """Wait for every commit in flight (errors included: the caller decides)."""
        while self._pending:
            future = self._pending[0]
            with contextlib.suppress(Exception):
                await asyncio.shield(future)
            if self._pending and self._pending[0] is future:
                self._pending.popleft()

    def _start_publish(self, event: Event, final: SessionState | None) -> asyncio.Future[None]:
        """The event's commit under way (held back until the session's row is in)."""
        if self._gate is not None:
            return self._gate.submit(event, final)
        return self._begin(event, final)

    def _begin(self, event: Event, final: SessionState | None) -> asyncio.Future[None]:
        """The event's commit; once it is done (and before anyone awaiting it resumes) the
        event is published."""
        committing = store_event(self.store, self.session_id, event)
        committing.add_done_callback(functools.partial(self._committed, event, final))
        return committing

    def _committed(
        self, event: Event, final: SessionState | None, commit: asyncio.Future[None]
    ) -> None:
        """Publish a committed event. After a failed commit, the events already on their way
        are not published (a listener would get the text with a piece missing); the session's
        ending events (issued later) are."""
        if commit.cancelled() or commit.exception() is not None:
            self._lost = self._lost or (event.index, self._issued or event.index)
        elif self._lost is None or not self._lost[0] < event.index <= self._lost[1]:
            self._publish(event, final)

    def _publish(self, event: Event, final: SessionState | None) -> None:
        """The event is stored (or needs no store): into the ring, and listeners woken."""
        self.ring.append(event)
        self.record.last_index = event.index
        self.record.updated_at = time.time()
        if final is not None:  # whoever sees [DONE] sees the final state too
            self.record.state = final
            self.finished_at = self.record.updated_at
        self._changed.wake()

    async def finish(self, emits: list[Emit], state: SessionState) -> None:
        """Append ``emits`` and the terminal ``[DONE]`` event, then record ``state``."""
        self._finishing = True
        self._stop_timers()
        try:
            for emit in emits:
                await self._commit(emit)
            await self._commit(Emit(DONE), final=state)
            await self.store.set_state(self.session_id, state)
        except Exception:
            logger.exception("session %s: could not persist its end (%s)", self.session_id, state)
        self.record.state = state
        self.finished_at = self.finished_at or time.time()
        await self._end()

    async def _end(self) -> None:
        self._ended = True
        self._changed.wake()

    def _error_emits(self, exc: BaseException) -> list[Emit]:
        logger.warning("session %s: producer failed: %r", self.session_id, exc)
        try:
            return self._on_error(exc) if self._on_error else []
        except Exception:
            logger.exception("session %s: on_error failed", self.session_id)
            return [error_emit("generation failed", "internal_error")]

    def _cancel_emits(self) -> list[Emit]:
        try:
            return self._on_cancel() if self._on_cancel else []
        except Exception:
            logger.exception("session %s: on_cancel failed", self.session_id)
            return []

    async def _settle(self) -> None:
        """Close the producer (so the backend stops) and wait for the commit in flight."""
        aclose = getattr(self._producer, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                logger.exception("session %s: closing the producer failed", self.session_id)
        await self._drain()

    # -- cancel ---------------------------------------------------------------------------

    def begin_cancel(self) -> asyncio.Task[None] | None:
        if not self.running or self.done:
            return None
        self._finishing = True
        self._cancel_task = asyncio.ensure_future(self._cancel())
        return self._cancel_task

    async def _cancel(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait([self._task])
        await self._settle()
        await self.finish(self._cancel_emits(), SessionState.CANCELLED)

    async def cancel(self) -> bool:
        """Stop the producer, append on_cancel's emits + ``[DONE]``; False if already ending."""
        task = self.begin_cancel()
        if task is None:
            return False
        await asyncio.shield(task)  # the caller going away must not leave it half-done
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Stop without recording a state: a shut-down session stays resumable like a crash."""
        self._stop_timers()
        if self._task is not None and not self._task.done():
            if not self._finishing:
                self._finishing = True
                self._task.cancel()
            await asyncio.wait([self._task], timeout=timeout)
        others = [t for t in (self._cancel_task, self._heartbeat) if t is not None]
        if others:
            await asyncio.wait(others, timeout=timeout)
        await self._settle()
        await self._end()

    async def wait(self) -> None:
        """Return once the session has ended (terminal event published, or closed)."""
        await self._changed.until(lambda: self._ended)

    # -- listeners, timer, heartbeat ------------------------------------------------------

    def attach(self) -> None:
        self.listeners += 1
        self._disarm()

    def detach(self) -> None:
        self.listeners -= 1
        if self.listeners == 0:
            self._arm()

    def _arm(self) -> None:
        delay = self.options.cancel_after_disconnect
        if delay > 0 and self._timer is None and self.running:
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_idle)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_idle(self) -> None:
        self._timer = None
        if self.listeners == 0 and self.begin_cancel() is not None:
            logger.info(
                "session %s: no listener for %.1fs, cancelled",
                self.session_id,
                self.options.cancel_after_disconnect,
            )

    def _stop_timers(self) -> None:
        self._disarm()
        if self._heartbeat is not None and self._heartbeat is not asyncio.current_task():
            self._heartbeat.cancel()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_interval)
            try:
                await self.store.heartbeat(self.session_id, self.record.owner)
                if self.store.shared:  # another replica may have cancelled it in the store
                    record = await self.store.get(self.session_id)
                    if record is not None and record.state is SessionState.CANCELLED:
                        self.begin_cancel()
                        return
            except Exception:
                logger.warning("session %s: heartbeat failed", self.session_id, exc_info=True)

    # -- reading --------------------------------------------------------------------------

    async def stream(self, after: int) -> AsyncGenerator[Event, None]:
        """Events with index > ``after`` until the terminal one, from the ring or the store."""
        nxt = after + 1
        self.attach()
        try:
            while True:
                batch = self._from_ring(nxt)
                if batch is None:
                    batch = await self._from_store(nxt)
                    if batch is None:
                        yield self._gap(nxt - 1)
                        return
                for event in batch:
                    if event.index < nxt:
                        continue
                    yield event
                    nxt = event.index + 1
                    if event.terminal:
                        return
                if not batch and not await self._wait_beyond(nxt - 1):
                    return
        finally:
            self.detach()

    def _from_ring(self, nxt: int) -> list[Event] | None:
        return ring_tail(self.ring, self.record.last_index, nxt)

    async def _from_store(self, nxt: int) -> list[Event] | None:
        events = await self.store.events(self.session_id, nxt - 1)
        return events if events and events[0].index == nxt else None

    async def _wait_beyond(self, index: int) -> bool:
        await self._changed.until(lambda: self.record.last_index > index or self._ended)
        return self.record.last_index > index

    def _gap(self, index: int) -> Event:
        return gap_event(self.session_id, index)
