"""The store protocol: where session records and events live beyond one process's memory."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import orjson

from vlmserve.errors import InvalidRequest
from vlmserve.streaming.events import Event, SessionRecord, SessionState

__all__ = [
    "AppendNow",
    "SessionStore",
    "already_exists",
    "dump_meta",
    "dump_request",
    "load_meta",
    "store_event",
]

AppendNow = Callable[[str, Event], None]  # a store's append that is done when it returns


@runtime_checkable
class SessionStore(Protocol):
    """Async storage of session records and their numbered events.

    ``append`` is durable when it returns; ``events`` and ``wait_events`` return events with
    ``index > after`` in ascending order; ``get`` also finds a session by one of its aliases.
    """

    shared: bool  # True when several server processes may use the same store (Redis)

    async def create(self, record: SessionRecord) -> None: ...

    async def append(self, session_id: str, event: Event) -> None: ...

    async def set_state(self, session_id: str, state: SessionState) -> None: ...

    async def heartbeat(self, session_id: str, owner: str) -> None: ...

    async def get(self, session_id: str) -> SessionRecord | None: ...

    async def events(self, session_id: str, after: int) -> list[Event]: ...

    async def wait_events(self, session_id: str, after: int, timeout: float) -> list[Event]: ...

    async def gc(self, now: float | None = None) -> int: ...

    async def close(self) -> None: ...


def already_exists(name: str) -> InvalidRequest:
    return InvalidRequest(
        f"session {name!r} already exists; resume it with Last-Event-ID or use a new session id",
        param="session_id",
        code="session_exists",
    )


def dump_meta(meta: dict[str, Any] | None) -> str | None:
    """Per event (a chat chunk's token ids), so orjson: about 6x faster than ``json.dumps``."""
    return None if meta is None else dump_request(meta)


def dump_request(request: dict[str, Any]) -> str:
    """A dict (a session's request, inline images included) as JSON text: orjson, the
    standard library for what orjson refuses (an integer wider than 64 bits)."""
    try:
        return orjson.dumps(request, option=orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:
        return json.dumps(request)


def load_meta(text: str | None) -> dict[str, Any] | None:
    return None if not text else json.loads(text)


def store_event(store: SessionStore, session_id: str, event: Event) -> asyncio.Future[None]:
    """The event's append as a future: done at once with a store whose ``append_now`` is done
    when it returns (memory, SQLite's journal), the commit's own future with ``append_nowait``
    (Redis: no task or coroutine per event), else a task."""
    append_now: AppendNow | None = getattr(store, "append_now", None)
    if append_now is not None:
        stored: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            append_now(session_id, event)
            stored.set_result(None)
        except Exception as exc:
            stored.set_exception(exc)
        return stored
    append_nowait = getattr(store, "append_nowait", None)
    if append_nowait is not None:
        return append_nowait(session_id, event)  # type: ignore[no-any-return]
    return asyncio.ensure_future(store.append(session_id, event))
