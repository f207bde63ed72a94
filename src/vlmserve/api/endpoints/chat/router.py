"""``POST /v1/chat/completions``: JSON, or an SSE stream (new, or resumed with Last-Event-ID)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Query, Request, Response

from vlmserve.api.common.sse import (
    ClientGone,
    accepts_event_stream,
    run_until_disconnect,
    sse_response,
)
from vlmserve.api.common.timings import server_timing
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.chat.service import tenant_of
from vlmserve.api.json_response import json_response
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import ChatDep, OwnerDep
from vlmserve.errors import InvalidRequest
from vlmserve.streaming import parse_event_id

router = APIRouter(route_class=StrictJSONRoute)
log = logging.getLogger(__name__)


def _resumable(request: Request, body: ChatCompletionRequest, resuming: bool) -> bool:
    """The wire of the answer (see ``vlmserve.api.common.sse``): ``stream_options.resumable``
    when given, else ``id:`` lines for a resume or an ``Accept: text/event-stream`` client."""
    chosen = body.stream_options.resumable if body.stream_options else None
    if chosen is not None:
        return chosen
    return resuming or accepts_event_stream(request.headers.get("accept"))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: Request,
    chat: ChatDep,
    owner: OwnerDep,
    body: ChatCompletionRequest,
    last_event_id: str | None = Query(default=None, max_length=300),
) -> Any:
    request_id = request.state.request_id
    request.state.model = body.model  # the metrics' model label
    if body.unknown_fields:  # accepted for client compatibility (as vLLM), but said out loud
        log.warning(
            "%s: unknown fields %s: not used here (a proxied model gets them as sent)",
            request_id,
            body.unknown_fields,
        )
    resume_from = request.headers.get("last-event-id") or last_event_id
    if resume_from:
        session_id, after = parse_event_id(resume_from)
        if body.session_id and body.session_id != session_id:
            raise InvalidRequest(
                f"Last-Event-ID names session {session_id!r} but session_id is {body.session_id!r}",
                param="session_id",
            )
        resumable = _resumable(request, body, resuming=True)
        return await sse_response(
            chat.sessions, session_id, after, resumable=resumable, tenant=tenant_of(owner)
        )
    if body.stream:
        session_id, token = await chat.start_stream(body, request_id, owner)
        resumable = _resumable(request, body, resuming=False)
        return await sse_response(
            chat.sessions,
            session_id,
            -1,
            resumable=resumable,
            tenant=tenant_of(owner),
            resume_token=token,
            fresh=True,
        )
    try:
        answer, timings = await run_until_disconnect(
            request, chat.complete_timed(body, request_id, owner=owner)
        )
    except ClientGone:
        return Response(status_code=499)
    response = await json_response(answer)
    if timings is not None:
        response.headers["Server-Timing"] = server_timing(timings)
    return response
