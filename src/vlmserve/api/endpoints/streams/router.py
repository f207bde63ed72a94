"""Stream control: cancel by session or completion id, resume with a plain GET.

Every name is the caller's key's (``streaming/scope.py``): another key's session or alias is
the 404 of an unknown id. ``GET /v1/streams/{id}?token=`` without a key opens the one session
that resume token was issued for (``resume_token.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from vlmserve.api.common.sse import sse_response
from vlmserve.api.endpoints.chat.service import tenant_of
from vlmserve.api.resume_token import RESUME_TOKEN_OWNER, token_alias
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import OwnerDep, SessionsDep
from vlmserve.errors import NotFound
from vlmserve.streaming import SessionManager, SessionRecord, parse_event_id
from vlmserve.streaming.scope import scoped, unscoped

router = APIRouter(route_class=StrictJSONRoute)


def _no_stream(key: str) -> NotFound:
    return NotFound(
        f"unknown session {key!r}: it never existed for this API key or has expired",
        code="session_not_found",
    )


async def _not_a_response(sessions: SessionManager, key: str, tenant: str) -> None:
    """A stored response's session is read with ``/v1/responses/{id}``: these routes answer
    for it as for an unknown id."""
    record = await sessions.store.get(scoped(tenant, key)) if key.startswith("resp_") else None
    if record is not None and record.request.get("kind") == "response":
        raise NotFound(
            f"no stream {key!r}; a response is read with GET /v1/responses/{{id}} "
            "and cancelled with POST /v1/responses/{id}/cancel",
            code="session_not_found",
        )


async def by_token(sessions: SessionManager, name: str, token: str | None) -> SessionRecord:
    """The session ``token`` was issued for, if ``name`` is one of its names (its id, or a
    chat stream's ``chatcmpl-`` id); anything else is an unknown id's 404."""
    record = None if not token else await sessions.record(token_alias(token))
    names = [] if record is None else [record.session_id, *record.aliases]
    if record is None or name not in {unscoped(n) for n in names if not n.startswith("rt-")}:
        raise _no_stream(name)
    return record


async def _cancel(sessions: SessionManager, key: str, owner: str) -> dict[str, object]:
    await _not_a_response(sessions, key, tenant_of(owner))
    if not await sessions.cancel(key, tenant_of(owner)):
        raise NotFound(
            f"no running stream {key!r} (unknown, finished or already cancelled)",
            code="session_not_found",
        )
    return {"id": key, "object": "stream.cancel", "cancelled": True}


@router.post("/v1/cancel/{session_id}")
async def cancel_session(
    sessions: SessionsDep, owner: OwnerDep, session_id: str
) -> dict[str, object]:
    """Cancel a running generation by session id (or chat-completion id)."""
    return await _cancel(sessions, session_id, owner)


@router.post("/v1/chat/completions/{completion_id}/cancel")
async def cancel_completion(
    sessions: SessionsDep, owner: OwnerDep, completion_id: str
) -> dict[str, object]:
    """Cancel a running generation by its ``chatcmpl-...`` id."""
    return await _cancel(sessions, completion_id, owner)


@router.get("/v1/streams/{session_id}", response_model=None)
async def resume_stream(
    request: Request,
    sessions: SessionsDep,
    owner: OwnerDep,
    session_id: str,
    last_event_id: str | None = Query(default=None, max_length=300),
    token: str | None = Query(default=None, max_length=128),
) -> Response:
    """Resume (or replay) a stream, always with ``id:`` lines. Works with browsers'
    EventSource, which reconnects with a GET and the ``Last-Event-ID`` header by itself: at or
    past the end of an ended stream the answer is 204, which tells it to stop. Without an API
    key (keys configured), ``?token=`` (the stream's ``X-Resume-Token``) opens it."""
    given = request.headers.get("last-event-id") or last_event_id
    after = -1
    if given:
        named, after = parse_event_id(given)
        if named != session_id:
            raise NotFound(f"Last-Event-ID is for session {named!r}, not {session_id!r}")
    if owner == RESUME_TOKEN_OWNER:
        record = await by_token(sessions, session_id, token)
        if record.request.get("kind") == "response":
            raise _no_stream(session_id)
        return await sse_response(
            sessions, session_id, after, resumable=True, stored_as=record.session_id
        )
    await _not_a_response(sessions, session_id, tenant_of(owner))
    return await sse_response(sessions, session_id, after, resumable=True, tenant=tenant_of(owner))
