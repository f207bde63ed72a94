"""SessionManager: starts sessions, routes listeners, cancels, takes over orphaned sessions, gc.

Where a listener's events come from:
    session in this process           -> its ring buffer (+ the store for events the ring lost)
    in the store, final state         -> replay from the store
    in the store, RUNNING, produced by
      another live replica (shared)   -> follow the store (``wait_events``) until [DONE]
    in the store, RUNNING, orphaned   -> the resumer continues it here, or it ends with a
      (crash, restart, stale owner)      ``server_restart`` error + [DONE]

A listener ``after`` the events a running session has produced so far waits for the next
ones, as a live one does (``starting_after=3`` before a background response made event 4);
at or past the end of an ended session it gets nothing (the API answers 204). Names are per
``tenant`` (``scope.py``: an API key's digest, ``""`` without keys); ``secret_aliases`` (a
resume token's digest) are in no namespace: only who holds the secret finds them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from types import MappingProxyType
from typing import Any

from vlmserve.errors import InvalidRequest, NotFound
from vlmserve.streaming.cancels import CancelWatch
from vlmserve.streaming.events import (
    DONE,
    FINAL_STATES,
    Emit,
    Event,
    OnCancel,
    OnError,
    Resumer,
    Resumption,
    SessionRecord,
    SessionState,
    error_emit,
    gap_event,
)
from vlmserve.streaming.scope import scoped, unscoped
from vlmserve.streaming.session import Session, SessionOptions
from vlmserve.streaming.sse import validate_session_id
from vlmserve.streaming.store.base import SessionStore, already_exists

__all__ = ["Listener", "SessionManager"]

logger = logging.getLogger(__name__)


class Listener:
    """What ``SessionManager.listen`` returns: an async iterator of events.

    ``await`` it first to resolve the session before sending anything (raises NotFound, so the
    API can answer 404), or just iterate it (then the first ``__anext__`` raises).
    """

    __slots__ = ("_after", "_gen", "_manager", "_name")

    def __init__(self, manager: SessionManager, name: str, after: int) -> None:
        self._manager, self._name, self._after = manager, name, after
        self._gen: AsyncGenerator[Event, None] | None = None

    def __await__(self) -> Generator[Any, None, Listener]:
        return self._open().__await__()

    async def _open(self) -> Listener:
        if self._gen is None:
            self._gen = await self._manager._open(self._name, self._after)
        return self

    def __aiter__(self) -> Listener:
        return self

    async def __anext__(self) -> Event:
        await self._open()
        assert self._gen is not None
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()


class SessionManager:
    def __init__(
        self,
        store: SessionStore,
        *,
        ring_size: int = 2048,
        cancel_after_disconnect: float = 3600.0,
        ttl: float = 600.0,
        owner: str | None = None,
        heartbeat_interval: float = 2.0,
        stale_after: float = 10.0,
        follow_poll: float = 1.0,
        gc_interval: float = 60.0,
    ) -> None:
        self.store = store
        self.options = SessionOptions(ring_size, cancel_after_disconnect, heartbeat_interval)
        self.ttl = ttl
        self.owner = owner or uuid.uuid4().hex
        self.stale_after = stale_after
        self.follow_poll = follow_poll  # seconds one wait_events call blocks while following
        self.gc_interval = gc_interval  # 0 = only when gc() is called
        self._sessions: dict[str, Session] = {}
        self._aliases: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._resumer: Resumer | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self._cancel_watch = CancelWatch(store, self.get)

    @property
    def sessions(self) -> MappingProxyType[str, Session]:
        return MappingProxyType(self._sessions)

    @property
    def durable(self) -> bool:
        """Whether events outlive this process (SQLite, Redis): a restarted server continues."""
        return bool(getattr(self.store, "durable", True))

    def active_count(self) -> int:
        return sum(1 for s in self._sessions.values() if not s.done)

    def get(self, session_id: str, tenant: str = "") -> Session | None:
        """The session held in this process, by id or alias (in ``tenant``'s namespace)."""
        name = scoped(tenant, session_id)
        return self._sessions.get(self._aliases.get(name, name))

    async def exists(self, session_id: str, tenant: str = "") -> bool:
        """Whether a session with this id or alias is held here or in the store."""
        name = scoped(tenant, session_id)
        return self.get(name) is not None or await self.store.get(name) is not None

    async def record(self, session_id: str, tenant: str = "") -> SessionRecord | None:
        """The stored record of a session by id or alias (the one held here first: the memory
        store's record of a running session lags behind it)."""
        session = self.get(session_id, tenant)
        if session is not None:
            return dataclasses.replace(session.record, aliases=list(session.record.aliases))
        return await self.store.get(scoped(tenant, session_id))

    def set_resumer(self, fn: Resumer | None) -> None:
        self._resumer = fn

    async def start(
        self,
        session_id: str,
        request: dict[str, Any],
        producer: AsyncIterator[Emit],
        *,
        on_cancel: OnCancel,
        on_error: OnError,
        aliases: Sequence[str] = (),
        tenant: str = "",
        secret_aliases: Sequence[str] = (),
    ) -> Session:
        """Record the session in the store and run ``producer`` (with or without listeners).
        Its id and ``aliases`` are ``tenant``'s; ``secret_aliases`` are in no namespace."""
        for name in (session_id, *aliases, *secret_aliases):
            validate_session_id(name)
        now = time.time()
        names = [scoped(tenant, alias) for alias in aliases] + list(secret_aliases)
        record = SessionRecord(
            scoped(tenant, session_id),
            dict(request),
            SessionState.RUNNING,
            now,
            now,
            owner=self.owner,
            aliases=names,
        )
        if getattr(self.store, "instant", False):
            await self.store.create(record)  # raises InvalidRequest when the id is taken
            session = self._register(record)
            session.start(producer, on_cancel, on_error)
        else:
            session = await self._start_before_commit(record, producer, on_cancel, on_error)
        self._ensure_background()
        return session

    async def _start_before_commit(
        self,
        record: SessionRecord,
        producer: AsyncIterator[Emit],
        on_cancel: OnCancel,
        on_error: OnError,
    ) -> Session:
        """A durable store: the producer starts while the session's row is committed; its
        events follow the row (``rowgate.py`` says why)."""
        for name in (record.session_id, *record.aliases):
            if self.get(name) is not None:
                raise already_exists(name)
        session = self._register(record)
        created = asyncio.ensure_future(self.store.create(record))
        session.start(producer, on_cancel, on_error, created=created)
        try:
            await asyncio.shield(created)  # InvalidRequest when the id is taken in the store
        except BaseException:
            await session.close()  # nothing of it was committed; the engine stops
            self._forget(record)
            raise
        return session

    def _forget(self, record: SessionRecord) -> None:  # undo _register: its names were free
        self._sessions.pop(record.session_id, None)
        for alias in record.aliases:
            self._aliases.pop(alias, None)

    def _register(self, record: SessionRecord) -> Session:
        session = Session(record, self.store, self.options)
        self._sessions[record.session_id] = session
        for alias in record.aliases:
            self._aliases[alias] = record.session_id
        return session

    def listen(self, session_id: str, after: int = -1, tenant: str = "") -> Listener:
        """Every event with index > ``after``, then live ones until the terminal ``[DONE]``
        (``after`` ahead of the events produced so far: those after it, once they are)."""
        validate_session_id(session_id)
        if isinstance(after, bool) or not isinstance(after, int) or after < -1:
            raise InvalidRequest(
                f"invalid event index {after!r}: expected an integer >= -1",
                param="Last-Event-ID",
                code="invalid_last_event_id",
            )
        return Listener(self, scoped(tenant, session_id), after)

    async def _open(self, name: str, after: int) -> AsyncGenerator[Event, None]:
        session = self.get(name)
        if session is not None:
            return session.stream(after)
        record = await self.store.get(name)
        if record is None:
            raise NotFound(
                f"unknown session {unscoped(name)!r}: it never existed here or has expired "
                f"(finished sessions are kept {self.ttl:g}s)",
                code="session_not_found",
            )
        session = self._sessions.get(record.session_id)
        if session is not None:
            return session.stream(after)
        if record.state in FINAL_STATES:
            return self._replay(record, after)
        if self._live_elsewhere(record):
            return self._follow(record, after)
        session = await self._take_over(record.session_id)
        if session is None:  # ended or claimed by another replica meanwhile: look again
            return await self._open(name, after)
        return session.stream(after)

    def _live_elsewhere(self, record: SessionRecord) -> bool:
        """Another replica produces it and its heartbeat is fresh."""
        return (
            self.store.shared
            and record.owner != self.owner
            and time.time() - record.updated_at <= self.stale_after
        )

    async def _replay(self, record: SessionRecord, after: int) -> AsyncGenerator[Event, None]:
        sid = record.session_id
        events = await self.store.events(sid, after)
        if (events and events[0].index != after + 1) or (not events and record.last_index > after):
            yield gap_event(sid, after)
            return
        for event in events:
            yield event
            if event.terminal:
                return
        if self._live_elsewhere(record):  # cancelled in the store; its owner still ends it
            async for event in self._follow(record, events[-1].index if events else after):
                yield event

    async def _follow(self, record: SessionRecord, after: int) -> AsyncGenerator[Event, None]:
        sid, nxt = record.session_id, after + 1
        while True:
            events = await self.store.wait_events(sid, nxt - 1, self.follow_poll)
            if events and events[0].index != nxt:
                yield gap_event(sid, nxt - 1)
                return
            for event in events:
                yield event
                nxt = event.index + 1
                if event.terminal:
                    return
            if events:
                continue
            current = await self.store.get(sid)
            if current is not None and current.last_index >= nxt:
                newer = await self.store.events(sid, nxt - 1)  # appended since the wait ended?
                if newer and newer[0].index == nxt:
                    continue
            if current is None or current.last_index >= nxt:
                yield gap_event(sid, nxt - 1)
                return
            if self._live_elsewhere(current):
                continue
            if current.state in FINAL_STATES:
                return
            session = await self._take_over(sid)  # its owner stopped heartbeating
            if session is not None:
                async for event in session.stream(nxt - 1):
                    yield event
                return

    async def _take_over(self, sid: str) -> Session | None:
        """Continue an orphaned session here; None when it turned out not to be orphaned."""
        async with self._locks.setdefault(sid, asyncio.Lock()):
            if sid in self._sessions:
                return self._sessions[sid]
            record = await self.store.get(sid)
            if record is None or record.state in FINAL_STATES or self._live_elsewhere(record):
                return None
            events = await self.store.events(sid, -1)
            if events and events[-1].terminal:  # it ended, but the state was never recorded
                failed = len(events) > 1 and events[-2].event == "error"
                await self.store.set_state(
                    sid, SessionState.FAILED if failed else SessionState.FINISHED
                )
                return None
            await self.store.heartbeat(sid, self.owner)  # claim it before the slow part
            resumption = await self._resume(record, events)
            session = self._register(dataclasses.replace(record, owner=self.owner))
            if events and events[-1].index >= record.last_index:
                session.seed(events)
            if resumption is None:
                message = (
                    "the server restarted while generating this stream and cannot continue "
                    "it; send the request again"
                )
                await session.finish([error_emit(message, "server_restart")], SessionState.FAILED)
            else:
                session.start(resumption.producer, resumption.on_cancel, resumption.on_error)
                self._ensure_background()
            return session

    async def _resume(self, record: SessionRecord, events: list[Event]) -> Resumption | None:
        if self._resumer is None:
            return None
        try:
            return await self._resumer(dataclasses.replace(record), events)
        except Exception:
            logger.exception("session %s: the resumer failed", record.session_id)
            return None

    async def cancel(self, session_id: str, tenant: str = "") -> bool:
        """Cancel by id or alias; False when unknown or already ended."""
        session_id = scoped(tenant, session_id)
        session = self.get(session_id)
        if session is not None:
            return await session.cancel()
        record = await self.store.get(session_id)
        if record is None or record.state in FINAL_STATES:
            return False
        sid = record.session_id
        if sid in self._sessions:
            return await self._sessions[sid].cancel()
        if self._live_elsewhere(record):
            # Its owner hears of it at once (CancelWatch), or at its next heartbeat, and ends it.
            await self.store.set_state(sid, SessionState.CANCELLED)
            return True
        async with self._locks.setdefault(sid, asyncio.Lock()):  # orphaned: end it here
            record = await self.store.get(sid)
            if record is None or record.state in FINAL_STATES or sid in self._sessions:
                return False
            done = Event(record.last_index + 1, DONE, terminal=True)
            await self.store.append(sid, done)
            await self.store.set_state(sid, SessionState.CANCELLED)
        return True

    async def gc(self, now: float | None = None) -> int:
        """Drop sessions ended more than ``ttl`` ago here and in the store; returns the count."""
        now = time.time() if now is None else now
        cutoff = now - self.ttl
        expired = [
            sid
            for sid, s in self._sessions.items()
            if s.done and s.finished_at is not None and s.finished_at < cutoff
        ]
        for sid in expired:
            for alias in self._sessions.pop(sid).record.aliases:
                self._aliases.pop(alias, None)
        for sid in [sid for sid, lock in self._locks.items() if not lock.locked()]:
            if sid not in self._sessions:
                del self._locks[sid]
        return len(expired) + await self.store.gc(now)

    def _ensure_background(self) -> None:
        self._cancel_watch.ensure()
        if self.gc_interval > 0 and (self._gc_task is None or self._gc_task.done()):
            self._gc_task = asyncio.ensure_future(self._gc_loop())

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval)
            try:
                await self.gc()
            except Exception:
                logger.exception("session gc failed")

    async def close(self) -> None:
        """Stop timers and producers without recording a state (resumable like a crash).
        The store stays open: whoever built it closes it."""
        if self._gc_task is not None:
            self._gc_task.cancel()
            await asyncio.gather(self._gc_task, return_exceptions=True)
        await self._cancel_watch.close()
        await asyncio.gather(*(s.close() for s in self._sessions.values()))
        self._sessions.clear()
        self._aliases.clear()
