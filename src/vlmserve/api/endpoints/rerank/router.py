"""``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``) and ``POST /v1/score`` (``/score``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from vlmserve.api.endpoints.rerank.protocol import RerankRequest, ScoreRequest
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import OwnerDep, RerankDep

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(
    request: Request, service: RerankDep, owner: OwnerDep, body: RerankRequest
) -> dict[str, Any]:
    request.state.model = body.model  # the metrics' model label
    return await service.rerank(body, owner)


@router.post("/v1/score")
@router.post("/score")
async def score(
    request: Request, service: RerankDep, owner: OwnerDep, body: ScoreRequest
) -> dict[str, Any]:
    request.state.model = body.model
    return await service.score(body, owner)
