"""Seed 000's worker endpoints, exact contract (400 on empty input, 503 while loading)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from vlmserve.api.protocol.worker import (
    CaptionRequest,
    CaptionResponse,
    EmbeddingResponse,
    EncodeTextRequest,
    EncodeVideoRequest,
    GenerateRequestIn,
    GenerateResponse,
)
from vlmserve.api.routing import StrictJSONRoute

router = APIRouter(tags=["worker"], route_class=StrictJSONRoute)


@router.post("/encode-video")
async def encode_video(request: Request, body: EncodeVideoRequest) -> EmbeddingResponse:
    """Embed a clip given as base64 JPEG frames ("Represent the given video clip.")."""
    vector = await request.app.state.worker.encode_video(body.frames, body.model)
    return EmbeddingResponse(embedding=vector)


@router.post("/encode-text")
async def encode_text(request: Request, body: EncodeTextRequest) -> EmbeddingResponse:
    """Embed a search query for retrieving video clips."""
    return EmbeddingResponse(
        embedding=await request.app.state.worker.encode_text(body.text, body.model)
    )


@router.post("/caption")
async def caption(request: Request, body: CaptionRequest) -> CaptionResponse:
    """Describe a clip (frames + optional transcript), at most 512 new tokens."""
    return CaptionResponse(caption=await request.app.state.worker.caption(body))


@router.post("/generate")
async def generate(request: Request, body: GenerateRequestIn) -> GenerateResponse:
    """Free generation from OpenAI-style messages (NER, triples, ...)."""
    return GenerateResponse(text=await request.app.state.worker.generate(body))
