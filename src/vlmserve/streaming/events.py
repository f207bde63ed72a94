"""Value types of a resumable stream: what producers yield, what listeners get, what stores keep.

A producer yields ``Emit`` values; the session numbers them into ``Event`` values (index 0, 1, ...)
and ends every session with one terminal ``[DONE]`` event. ``SessionRecord`` is the persisted
description of a session (request, state, owner, last index) that lets another process, or this one
after a restart, replay or continue it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vlmserve.streaming.scope import unscoped

__all__ = [
    "DONE",
    "FINAL_STATES",
    "Emit",
    "Event",
    "OnCancel",
    "OnError",
    "Resumer",
    "Resumption",
    "SessionRecord",
    "SessionState",
    "error_emit",
    "error_event",
    "gap_event",
    "ring_tail",
]

DONE = "[DONE]"


@dataclass(slots=True, frozen=True)
class Emit:
    """What a producer yields; the session gives it an index."""

    data: str  # SSE data payload (JSON text)
    event: str | None = None  # SSE event type; None = default; "error" for error events
    meta: dict[str, Any] | None = None  # stored, never sent (the API keeps token ids here)


@dataclass(slots=True, frozen=True)
class Event:
    """One numbered event of a session; its SSE id is ``<session_id>:<index>``."""

    index: int
    data: str
    event: str | None = None
    meta: dict[str, Any] | None = None
    terminal: bool = False  # the `[DONE]` event that ends the session


class SessionState(str, Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


FINAL_STATES = frozenset({SessionState.FINISHED, SessionState.CANCELLED, SessionState.FAILED})


@dataclass(slots=True)
class SessionRecord:
    """The persisted description of a session. ``request`` must be JSON-serialisable."""

    session_id: str
    request: dict[str, Any]
    state: SessionState
    created_at: float  # time.time()
    updated_at: float  # time.time() of the last append, state change or heartbeat
    last_index: int = -1
    owner: str = ""  # the SessionManager.owner that produces it
    aliases: list[str] = field(default_factory=list)


def _error_data(message: str, code: str, type_: str) -> str:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


def error_emit(message: str, code: str, type_: str = "server_error") -> Emit:
    """An SSE ``error`` event in the OpenAI error shape."""
    return Emit(data=_error_data(message, code, type_), event="error")


def error_event(index: int, message: str, code: str, type_: str = "server_error") -> Event:
    """A numbered error event that no store keeps (the stream_gap notice)."""
    return Event(index=index, data=_error_data(message, code, type_), event="error")


def gap_event(session_id: str, index: int) -> Event:
    """The one error event a listener gets when the events it asks for are gone; its id is the
    last one the client has, so a client retrying with it gets the same answer."""
    return error_event(
        index,
        f"events after {unscoped(session_id)}:{index} are no longer held (the in-memory buffer "
        "is bounded and the store has no older ones); send the request again to start a new "
        "stream",
        "stream_gap",
    )


OnCancel = Callable[[], list[Emit]]  # emits to append before [DONE] when a session is cancelled
OnError = Callable[[BaseException], list[Emit]]  # emits to append before [DONE] on a failure


@dataclass(slots=True)
class Resumption:
    """How to continue an orphaned session: numbering goes on at ``last_index + 1``."""

    producer: AsyncIterator[Emit]
    on_cancel: OnCancel
    on_error: OnError


# Given the stored record and its persisted events, continue the generation (or None).
Resumer = Callable[[SessionRecord, list[Event]], Awaitable[Resumption | None]]


def ring_tail(ring: Sequence[Event], last: int, nxt: int) -> list[Event] | None:
    """The events from index ``nxt`` on in ``ring`` (ascending indices, the newest ``last``);
    None when ``nxt`` is older than the ring holds."""
    if nxt > last:
        return []
    first = ring[0].index if ring else last + 1
    if nxt < first:
        return None
    n, k = len(ring), last - nxt + 1
    if k <= n and ring[n - k].index == nxt:
        return [ring[i] for i in range(n - k, n)]
    return [e for e in ring if e.index >= nxt]  # past events a failed commit lost
