"""A session's write path: number each event, make it durable, then publish it.

Publishing puts the event in the ring buffer and wakes the listeners, so anything a listener
sees in the ring is also in the store. A store whose ``append_now`` is done when it returns
(memory, SQLite's journal): the event is published inline, no task or future per event. One
that commits later (Redis): up to ``IN_FLIGHT`` events are on their way at once
(group-committed, in order), each published from its commit's done callback; the terminal
event waits for all. Events that come before a new durable session's row is committed wait
for it (``rowgate.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmserve.streaming.events import Emit, Event, SessionRecord, SessionState
from vlmserve.streaming.rowgate import RowGate
from vlmserve.streaming.signal import Signal
from vlmserve.streaming.store.base import AppendNow, SessionStore, store_event

__all__ = ["IN_FLIGHT", "Publisher"]

IN_FLIGHT = 16  # events of one session being committed at once


@dataclass(slots=True, eq=False)
class Publisher:
    record: SessionRecord
    store: SessionStore
    ring: deque[Event]
    on_lost: Callable[[BaseException], None]  # a commit failed while nobody awaited it
    changed: Signal = field(default_factory=Signal)  # an event published, or the end
    finished_at: float | None = None  # time.time() when the terminal event was published
    _pending: deque[asyncio.Future[None]] = field(default_factory=deque)  # commits in flight
    _issued: int | None = None  # the last index handed out (None: record.last_index)
    _lost: tuple[int, int] | None = None  # a failed commit's index .. the last one issued then
    _lost_error: BaseException | None = None  # why it failed: refuses the producer's next events
    ending: bool = False  # the session's ending events (error, [DONE]) are being committed
    _append_now: AppendNow | None = None  # the store's append done when it returns: inline
    _gate: RowGate | None = None  # a new durable session: its events follow its row

    def __post_init__(self) -> None:
        self._append_now = getattr(self.store, "append_now", None)

    def hold_for(self, created: asyncio.Future[None]) -> None:
        """Every event waits for ``created``, the store's commit of the session's row."""
        self._gate = RowGate(created, self._begin)

    async def commit(self, emit: Emit, final: SessionState | None = None) -> None:
        """Number ``emit`` and send it to the store; wait only when ``IN_FLIGHT`` commits
        are under way, or for every one of them when the event is the terminal one. Once an
        event's commit has failed, the producer's next events are refused with its error (a
        listener would get the text with a piece missing); only the ending ones go on."""
        if self._lost_error is not None and not self.ending:
            raise self._lost_error
        index = (self.record.last_index if self._issued is None else self._issued) + 1
        self._issued = index
        event = Event(index, emit.data, emit.event, emit.meta, terminal=final is not None)
        if self._inline(index):  # nothing to wait for
            self._pending.clear()  # all done: every earlier event is published
            self._append_now(self.record.session_id, event)  # type: ignore[misc]
            self._publish(event, final)
            await asyncio.sleep(0)  # listeners read before the next event, as below
            return
        publishing = self._start(event, final)
        if final is None:
            publishing.add_done_callback(self._published)
        self._pending.append(publishing)
        await asyncio.sleep(0)  # let the commit start and listeners read
        while self._pending and (final is not None or len(self._pending) >= IN_FLIGHT):
            # Shielded: a cancel must not leave it unknown whether the store got the event.
            await asyncio.shield(self._pending[0])
            self._pending.popleft()

    async def drain(self) -> None:
        """Wait for every commit in flight (errors included: the caller decides)."""
        while self._pending:
            future = self._pending[0]
            with contextlib.suppress(Exception):
                await asyncio.shield(future)
            if self._pending and self._pending[0] is future:
                self._pending.popleft()

    def _inline(self, index: int) -> bool:
        """Whether event ``index`` can be appended and published at once: the store's append
        is done when it returns, the session's row is in, and every earlier event is out."""
        gate_open = self._gate is None or self._gate.open
        return self._append_now is not None and self.record.last_index == index - 1 and gate_open

    def _published(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and (exc := future.exception()) is not None:
            self.on_lost(exc)

    def _start(self, event: Event, final: SessionState | None) -> asyncio.Future[None]:
        """The event's commit under way (held back until the session's row is in)."""
        if self._gate is not None:
            return self._gate.submit(event, final)
        return self._begin(event, final)

    def _begin(self, event: Event, final: SessionState | None) -> asyncio.Future[None]:
        """The event's commit; once it is done (and before anyone awaiting it resumes) the
        event is published."""
        committing = store_event(self.store, self.record.session_id, event)
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
            if self._lost_error is None:
                self._lost_error = (
                    commit.exception()
                    if not commit.cancelled()
                    else ConnectionError(f"event {event.index}'s commit was cancelled")
                )
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
        self.changed.wake()
