"""One resumable session: its producer task, cancellation, listeners and their disconnect
timer, heartbeat, and replay from the ring buffer or the store.

The write path (numbering, durability, publishing into the ring) is the session's
``Publisher`` (``publisher.py``). Generation never waits for listeners. When the last
listener leaves, a timer of ``cancel_after_disconnect`` seconds is armed; a new listener
disarms it.
"""

from __future__ import annotations

import asyncio
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
from vlmserve.streaming.publisher import Publisher
from vlmserve.streaming.store.base import SessionStore

__all__ = ["Session", "SessionOptions"]

logger = logging.getLogger(__name__)


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
    publisher: Publisher = field(init=False)
    _producer: AsyncIterator[Emit] | None = None
    _on_cancel: OnCancel | None = None
    _on_error: OnError | None = None
    _task: asyncio.Task[None] | None = None
    _cancel_task: asyncio.Task[None] | None = None
    _heartbeat: asyncio.Task[None] | None = None
    _timer: asyncio.TimerHandle | None = None
    _store_error: BaseException | None = None  # a commit that failed in the background
    _finishing: bool = False  # the end (normal, cancel or error) has begun
    _ended: bool = False  # terminal published, or stopped for good without one (shutdown)

    def __post_init__(self) -> None:
        ring: deque[Event] = deque(maxlen=max(1, self.options.ring_size))
        self.publisher = Publisher(self.record, self.store, ring, self._lost_commit)

    @property
    def ring(self) -> deque[Event]:
        return self.publisher.ring

    @property
    def finished_at(self) -> float | None:
        """time.time() when the terminal event was published."""
        return self.publisher.finished_at

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
            self.publisher.hold_for(created)
        self._task = asyncio.ensure_future(self._run())
        if self.options.heartbeat_interval > 0:
            self._heartbeat = asyncio.ensure_future(self._beat())
        if self.listeners == 0:
            self._arm()

    async def _run(self) -> None:
        assert self._producer is not None
        try:
            async for emit in self._producer:
                await self.publisher.commit(emit)
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

    def _lost_commit(self, exc: BaseException) -> None:
        """A commit failed while the producer was elsewhere (waiting for its next chunk):
        stop the producer, so the session ends as failed instead of waiting forever."""
        if self._store_error is not None:
            return
        self._store_error = exc
        if self._task is not None and not self._task.done() and not self._finishing:
            self._task.cancel()

    async def finish(self, emits: list[Emit], state: SessionState) -> None:
        """Append ``emits`` and the terminal ``[DONE]`` event, then record ``state``."""
        self._finishing = True
        self.publisher.ending = True
        self._stop_timers()
        try:
            for emit in emits:
                await self.publisher.commit(emit)
            await self.publisher.commit(Emit(DONE), final=state)
            await self.store.set_state(self.session_id, state)
        except Exception:
            logger.exception("session %s: could not persist its end (%s)", self.session_id, state)
        self.record.state = state
        self.publisher.finished_at = self.publisher.finished_at or time.time()
        await self._end()

    async def _end(self) -> None:
        self._ended = True
        self.publisher.changed.wake()

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
        await self.publisher.drain()

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
        await self.publisher.changed.until(lambda: self._ended)

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
        await self.publisher.changed.until(lambda: self.record.last_index > index or self._ended)
        return self.record.last_index > index

    def _gap(self, index: int) -> Event:
        return gap_event(self.session_id, index)
