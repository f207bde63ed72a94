"""``POST /v1/embeddings`` (OpenAI shape; vLLM's ``messages`` form for images and video)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from vlmserve.api.endpoints.embeddings.protocol import EmbeddingsRequest
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import WorkerDep

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/embeddings")
async def embeddings(
    request: Request, worker: WorkerDep, body: EmbeddingsRequest
) -> dict[str, Any]:
    request.state.model = body.model  # the metrics' model label
    return await worker.embeddings(body)
