"""Turn a session's events into an SSE response, and run JSON work until the client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from vlmserve.streaming import SessionManager, encode_event

__all__ = ["ClientGone", "run_until_disconnect", "sse_response"]

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


async def sse_response(
    sessions: SessionManager,
    session_id: str,
    after: int,
    extra_headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """Replay after ``after`` then follow live. Unknown sessions raise (-> 404) before any byte."""
    events = sessions.listen(session_id, after)
    first = await anext(events)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield encode_event(session_id, first)
            async for event in events:
                yield encode_event(session_id, event)
        finally:
            await events.aclose()

    headers = {**SSE_HEADERS, "X-Session-ID": session_id, **(extra_headers or {})}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which stops generation).

    The body was already read by FastAPI, so the next ASGI message can only be
    ``http.disconnect``; watching ``receive`` is cheaper and exact compared with polling
    ``request.is_disconnected()``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone
