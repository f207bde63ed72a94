"""``POST /v1/embeddings`` (OpenAI shape; vLLM's ``messages`` form for images and video)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from vlmserve.api.protocol.embeddings import EmbeddingsRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingsRequest) -> dict[str, Any]:
    return await request.app.state.worker.embeddings(body)
