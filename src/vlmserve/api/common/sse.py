"""Turn a session's events into an SSE response, and run JSON work until the client leaves.

Which wire a response uses (``vlmserve.streaming.sse`` describes both):

- the OpenAI wire (``data:`` lines only) by default, so that every OpenAI client parses it,
  including those that split on blank lines and strip ``data: `` (vLLM's benchmark, LiteLLM);
- the resumable wire (``id:`` and ``event:`` lines too) when the client asks for it: an
  ``Accept`` header naming ``text/event-stream`` (browsers' EventSource sends it; the openai
  SDK sends ``application/json``, httpx, curl and aiohttp ``*/*``), a ``Last-Event-ID`` header
  or ``?last_event_id=``, ``GET /v1/streams/...``, or ``stream_options.resumable: true``.
  ``stream_options.resumable: false`` asks for the OpenAI wire whatever else the request says.

Every stream response carries ``X-Session-ID``. Resuming where nothing can follow (at or past
the last event of an ended session) answers 204 without a body, which stops EventSource from
reconnecting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from vlmserve.api.resume_token import HEADER, with_token
from vlmserve.streaming import DONE, Event, SessionManager, encode_event
from vlmserve.streaming.sse import encode_data

__all__ = ["ClientGone", "accepts_event_stream", "run_until_disconnect", "sse_response"]

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_CLOSING_DONE = encode_data(Event(-1, DONE))


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


def accepts_event_stream(accept: str | None) -> bool:
    """Whether an ``Accept`` header names ``text/event-stream`` (with a weight above 0)."""
    for item in (accept or "").split(","):
        media, *params = (part.strip().lower() for part in item.split(";"))
        if media == "text/event-stream":
            weight = next((p[2:].strip() for p in params if p.startswith("q=")), "1")
            try:
                return float(weight) > 0
            except ValueError:
                return True
    return False


async def sse_response(
    sessions: SessionManager,
    session_id: str,
    after: int,
    *,
    resumable: bool,
    tenant: str = "",
    stored_as: str | None = None,
    resume_token: str | None = None,
    fresh: bool = False,
) -> Response:
    """Replay after ``after`` then follow live (an ``after`` ahead of the events produced so
    far waits for them). Unknown sessions raise (-> 404) before any byte; nothing left to send
    is a 204. ``session_id`` is the name the client knows, in ``tenant``'s namespace (or
    ``stored_as``, the session's stored name, found by its resume token); ``resume_token``: a
    new stream's token, in the ``X-Resume-Token`` header and the first event. ``fresh``: a
    stream started by this request, whose events are all to come (its first is the first
    token's, after the prefill): the headers go out now, without waiting for it."""
    headers = {**SSE_HEADERS, "X-Session-ID": session_id}
    if resume_token is not None:
        headers[HEADER] = resume_token
    if stored_as is None:
        events = sessions.listen(session_id, after, tenant)
    else:
        events = sessions.listen(stored_as, after)
    first: Event | None = None
    if not fresh:
        try:
            first = await anext(events)
        except StopAsyncIteration:  # at or past the end of an ended session
            await events.aclose()
            return Response(status_code=204, headers=headers)

    def encode(event: Event) -> bytes:
        return encode_event(session_id, event) if resumable else encode_data(event)

    async def body() -> AsyncIterator[bytes]:
        try:
            last = first if first is not None else await anext(events, None)
            if last is None:  # nothing stored (a started session always ends with an event)
                return
            if resume_token is not None and last.index == 0:
                yield encode(replace(last, data=with_token(last.data, resume_token)))
            else:
                yield encode(last)
            async for last in events:
                yield encode(last)
        finally:
            await events.aclose()
        if not resumable and not last.terminal:
            yield _CLOSING_DONE  # a stream_gap notice ends it: OpenAI clients wait for [DONE]

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
