"""Task endpoints: entities, triples, ID-card (KTP) OCR; thin: parse, call, answer.

``/ktp-ocr/`` is the path KTP clients call (multipart ``file``); ``/v1/extract/id-card`` takes JSON.
A model answer that does not parse or fit the schema is a 422 ``invalid_model_output``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, File, Request, Response, UploadFile

from vlmserve.api.common.sse import ClientGone, run_until_disconnect
from vlmserve.api.endpoints.tasks.protocol import (
    EntitiesRequest,
    IdCardRequest,
    IdCardValidateRequest,
    TriplesRequest,
)
from vlmserve.api.endpoints.tasks.service import id_card_body
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import OwnerDep, TasksDep

router = APIRouter(tags=["tasks"], route_class=StrictJSONRoute)


async def _answer(request: Request, work: Any) -> Any:
    try:
        return await run_until_disconnect(request, work)
    except ClientGone:
        return Response(status_code=499)


@router.post("/v1/extract/entities", response_model=None)
async def extract_entities(
    request: Request, service: TasksDep, owner: OwnerDep, body: EntitiesRequest
) -> Any:
    """Named entities ``{"entities": [{"text", "type"}], "model", "usage"}`` from text/media."""
    request.state.model = body.model
    return await _answer(request, service.entities(body, request.state.request_id, owner))


@router.post("/v1/extract/triples", response_model=None)
async def extract_triples(
    request: Request, service: TasksDep, owner: OwnerDep, body: TriplesRequest
) -> Any:
    """Knowledge triples ``{"triples": [{"subject", "predicate", "object"}], ...}``."""
    request.state.model = body.model
    return await _answer(request, service.triples(body, request.state.request_id, owner))


@router.post("/v1/extract/id-card", response_model=None)
async def extract_id_card(
    request: Request, service: TasksDep, owner: OwnerDep, body: IdCardRequest
) -> Any:
    """A KTP photo (URL/data URL/base64) -> the card's fields, normalised and checked."""
    request.state.model = body.model
    return await _answer(request, service.id_card(body, request.state.request_id, owner))


@router.post("/v1/extract/id-card/validate")
async def validate_id_card_fields(body: IdCardValidateRequest) -> dict[str, Any]:
    """Check KTP field values read elsewhere; the same normalisation and checks, no model."""
    return id_card_body(body.fields)


@router.post("/ktp-ocr/", response_model=None)
async def ktp_ocr(
    request: Request, service: TasksDep, owner: OwnerDep, file: UploadFile = File(...)
) -> Any:
    """Multipart ``file`` (a KTP photo) -> the card's fields as JSON."""
    return await _answer(request, service.ktp_upload(file, request.state.request_id, owner))
