"""Stream control (seed 003): cancel by session or completion id, resume with a plain GET."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import SessionsDep
from vlmserve.api.serving.sse import sse_response
from vlmserve.errors import NotFound
from vlmserve.streaming import SessionManager, parse_event_id

router = APIRouter(route_class=StrictJSONRoute)


async def _not_a_response(sessions: SessionManager, key: str) -> None:
    """A stored response's session is its API key's (``/v1/responses/{id}`` checks the owner):
    these key-blind routes answer for it as for an unknown id."""
    record = await sessions.store.get(key) if key.startswith("resp_") else None
    if record is not None and record.request.get("kind") == "response":
        raise NotFound(f"no stream {key!r}; a response is read with GET /v1/responses/{{id}} "
                       "and cancelled with POST /v1/responses/{id}/cancel",
                       code="session_not_found")  # fmt: skip


async def _cancel(sessions: SessionManager, key: str) -> dict[str, object]:
    await _not_a_response(sessions, key)
    if not await sessions.cancel(key):
        raise NotFound(
            f"no running stream {key!r} (unknown, finished or already cancelled)",
            code="session_not_found",
        )
    return {"id": key, "object": "stream.cancel", "cancelled": True}


@router.post("/v1/cancel/{session_id}")
async def cancel_session(sessions: SessionsDep, session_id: str) -> dict[str, object]:
    """Cancel a running generation by session id (or chat-completion id)."""
    return await _cancel(sessions, session_id)


@router.post("/v1/chat/completions/{completion_id}/cancel")
async def cancel_completion(sessions: SessionsDep, completion_id: str) -> dict[str, object]:
    """Cancel a running generation by its ``chatcmpl-...`` id."""
    return await _cancel(sessions, completion_id)


@router.get("/v1/streams/{session_id}", response_model=None)
async def resume_stream(
    request: Request,
    sessions: SessionsDep,
    session_id: str,
    last_event_id: str | None = Query(default=None, max_length=300),
) -> Response:
    """Resume (or replay) a stream, always with ``id:`` lines. Works with browsers'
    EventSource, which reconnects with a GET and the ``Last-Event-ID`` header by itself: at or
    past the end of an ended stream the answer is 204, which tells it to stop."""
    given = request.headers.get("last-event-id") or last_event_id
    after = -1
    if given:
        named, after = parse_event_id(given)
        if named != session_id:
            raise NotFound(f"Last-Event-ID is for session {named!r}, not {session_id!r}")
    await _not_a_response(sessions, session_id)
    return await sse_response(sessions, session_id, after, resumable=True)
