"""OpenAI's Responses API: ``/v1/responses`` create, retrieve (or resume its events), cancel,
delete, input items. The work is ``service.py`` beside it; every call sees only the
caller's own stored responses (another API key's is a 404)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from vlmserve.api.common.sse import ClientGone, run_until_disconnect
from vlmserve.api.endpoints.chat.service import tenant_of
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.api.endpoints.responses.sse import response_sse
from vlmserve.api.json_response import json_response
from vlmserve.api.resume_token import HEADER, RESUME_TOKEN_OWNER
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import OwnerDep, ResponsesDep
from vlmserve.errors import NotFound

router = APIRouter(route_class=StrictJSONRoute)
log = logging.getLogger(__name__)


@router.post("/v1/responses", response_model=None)
async def create_response(
    request: Request, responses: ResponsesDep, owner: OwnerDep, body: ResponsesRequest
) -> Any:
    """A response: JSON, or its events as SSE (``stream: true``); ``background: true`` answers
    at once and generates without a client."""
    request_id = request.state.request_id
    request.state.model = body.model  # the metrics' model label
    if body.unknown_fields:  # accepted for client compatibility (as vLLM), but said out loud
        log.warning("%s: unknown fields %s: not used", request_id, body.unknown_fields)
    if not body.store and not body.stream:
        try:
            answer = await run_until_disconnect(
                request, responses.complete_unstored(body, request_id, owner)
            )
        except ClientGone:
            return Response(status_code=499)
        return await json_response(answer)
    response_id, token = await responses.start(body, request_id, owner)
    if body.stream:
        # a store: false response is not retrievable: no token, which would open nothing
        return await response_sse(
            responses.manager(body.store),
            response_id,
            -1,
            tenant=tenant_of(owner),
            resume_token=token if body.store else None,
        )
    if body.background:
        answer = await responses.retrieve(response_id, owner)
        return JSONResponse(answer, headers={HEADER: token})
    try:
        answer = await run_until_disconnect(request, responses.finished(response_id, owner))
    except ClientGone:  # a plain request is cancelled with its client, as a chat completion is
        await responses.cancel(response_id, owner)
        return Response(status_code=499)
    return await json_response(answer)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(
    responses: ResponsesDep,
    owner: OwnerDep,
    response_id: str,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=0, le=2**62),
    token: str | None = Query(default=None, max_length=128),
) -> Any:
    """The stored response; with ``stream=true`` its events after ``starting_after`` (all when
    left out; ahead of those made so far: once they are), then live ones. Nothing left to send
    is a 204. Without an API key (keys configured), ``stream=true&token=`` (the response's
    ``X-Resume-Token``) opens its events."""
    after = -1 if starting_after is None else starting_after
    if owner == RESUME_TOKEN_OWNER:
        if not stream:  # the auth middleware lets no other token request in
            raise NotFound(f"no stored response {response_id!r}", code="response_not_found")
        record = await responses.by_token(response_id, token)
        return await response_sse(
            responses.sessions, response_id, after, stored_as=record.session_id
        )
    if not stream:
        return await responses.retrieve(response_id, owner)
    await responses.check_stored(response_id, owner)
    return await response_sse(responses.sessions, response_id, after, tenant=tenant_of(owner))


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(responses: ResponsesDep, owner: OwnerDep, response_id: str) -> Any:
    """Stop a running response; the answer is the response, status ``cancelled``."""
    return await responses.cancel(response_id, owner)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(responses: ResponsesDep, owner: OwnerDep, response_id: str) -> Any:
    """Forget a stored response (a running one is cancelled first); then it is a 404."""
    return await responses.delete(response_id, owner)


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    responses: ResponsesDep,
    owner: OwnerDep,
    response_id: str,
    after: str | None = Query(default=None, max_length=256),
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    include: list[str] | None = Query(default=None, alias="include[]"),
) -> Any:
    """The input the response answered (the earlier turns of ``previous_response_id``
    included), as OpenAI's list of message items, newest first (``order=asc``: oldest)."""
    del include  # image URLs are always included; no other includable applies here
    return await responses.input_items(response_id, owner, after=after, limit=limit, order=order)
