"""A response's events on the Responses wire: ``event: <type>`` + ``data: <json>`` per event.

OpenAI's clients read the ``type`` from the data and stop when the connection closes; no
``[DONE]`` is sent. A session error event that is not a response event (``stream_gap``, or
``server_restart`` when a stored response cannot continue) becomes an ``error`` event in
OpenAI's shape (``type``, ``code``, ``message``, ``param``, ``sequence_number``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Response
from fastapi.responses import StreamingResponse

from vlmserve.api.endpoints.chat.objects import sse_json
from vlmserve.api.resume_token import HEADER, with_token
from vlmserve.errors import InvalidRequest
from vlmserve.streaming import Event, Listener, SessionManager

__all__ = ["encode_response_event", "response_sse"]

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_data(event: Event) -> str:
    error = json.loads(event.data).get("error") or {}
    return sse_json(
        {
            "type": "error",
            "sequence_number": event.index,
            "code": error.get("code"),
            "message": error.get("message", "stream error"),
            "param": error.get("param"),
        }
    )


def encode_response_event(event: Event) -> bytes:
    kind = event.event or "message"
    data = _error_data(event) if kind == "error" else event.data
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _opened(sessions: SessionManager, name: str, after: int, tenant: str) -> Listener:
    try:
        return await sessions.listen(name, after, tenant)
    except InvalidRequest as exc:
        if exc.code != "invalid_last_event_id":
            raise
        message = exc.message.replace("Last-Event-ID", "starting_after")
        raise InvalidRequest(message, param="starting_after", code=exc.code) from None


async def response_sse(
    sessions: SessionManager,
    response_id: str,
    after: int,
    *,
    tenant: str = "",
    stored_as: str | None = None,
    resume_token: str | None = None,
) -> Response:
    """Events with ``sequence_number > after`` (ahead of those made so far: once they are),
    then live ones; 204 when none can follow. ``response_id`` in ``tenant``'s namespace, or
    ``stored_as`` (found by its resume token); ``resume_token``: a new response's token, in
    the ``X-Resume-Token`` header and its first event."""
    events = await _opened(sessions, stored_as or response_id, after, "" if stored_as else tenant)
    headers = {**_HEADERS, "X-Session-ID": response_id}
    if resume_token is not None:
        headers[HEADER] = resume_token
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    if first is None or first.terminal:
        await events.aclose()
        return Response(status_code=204, headers=headers)

    async def body() -> AsyncIterator[bytes]:
        try:
            opening = first
            if resume_token is not None and first.index == 0:
                opening = replace(first, data=with_token(first.data, resume_token))
            yield encode_response_event(opening)
            async for event in events:
                if event.terminal:
                    return
                yield encode_response_event(event)
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
