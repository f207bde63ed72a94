"""A response's events on the Responses wire: ``event: <type>`` + ``data: <json>`` per event.

OpenAI's clients read the ``type`` from the data and stop when the connection closes; no
``[DONE]`` is sent. A session error event that is not a response event (``stream_gap``, or
``server_restart`` when a stored response cannot continue) becomes an ``error`` event in
OpenAI's shape (``type``, ``code``, ``message``, ``param``, ``sequence_number``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Response
from fastapi.responses import StreamingResponse

from vlmserve.api.protocol.responses import sse_json
from vlmserve.errors import InvalidRequest
from vlmserve.streaming import Event, Listener, SessionManager

__all__ = ["encode_response_event", "response_sse"]

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_data(event: Event) -> str:
    error = json.loads(event.data).get("error") or {}
    return sse_json({"type": "error", "sequence_number": event.index,
                     "code": error.get("code"), "message": error.get("message", "stream error"),
                     "param": error.get("param")})  # fmt: skip


def encode_response_event(event: Event) -> bytes:
    kind = event.event or "message"
    data = _error_data(event) if kind == "error" else event.data
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _opened(sessions: SessionManager, response_id: str, after: int) -> Listener:
    try:
        return await sessions.listen(response_id, after)
    except InvalidRequest as exc:
        if exc.code != "invalid_last_event_id":
            raise
        message = exc.message.replace("Last-Event-ID", "starting_after")
        raise InvalidRequest(message, param="starting_after", code=exc.code) from None


async def response_sse(sessions: SessionManager, response_id: str, after: int) -> Response:
    """Events with ``sequence_number > after``, then live ones; 204 when none can follow."""
    events = await _opened(sessions, response_id, after)
    headers = {**_HEADERS, "X-Session-ID": response_id}
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    if first is None or first.terminal:
        await events.aclose()
        return Response(status_code=204, headers=headers)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield encode_response_event(first)
            async for event in events:
                if event.terminal:
                    return
                yield encode_response_event(event)
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
