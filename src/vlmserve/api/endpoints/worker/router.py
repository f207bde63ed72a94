"""The GPU worker's endpoints, exact contract (400 on empty input, 503 while loading)."""

from __future__ import annotations

from fastapi import APIRouter

from vlmserve.api.endpoints.worker.protocol import (
    CaptionRequest,
    CaptionResponse,
    EmbeddingResponse,
    EncodeTextRequest,
    EncodeVideoRequest,
    GenerateRequestIn,
    GenerateResponse,
)
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import WorkerDep

router = APIRouter(tags=["worker"], route_class=StrictJSONRoute)


@router.post("/encode-video")
async def encode_video(worker: WorkerDep, body: EncodeVideoRequest) -> EmbeddingResponse:
    """Embed a clip given as base64 JPEG frames ("Represent the given video clip.")."""
    vector = await worker.encode_video(body.frames, body.model)
    return EmbeddingResponse(embedding=vector)


@router.post("/encode-text")
async def encode_text(worker: WorkerDep, body: EncodeTextRequest) -> EmbeddingResponse:
    """Embed a search query for retrieving video clips."""
    return EmbeddingResponse(embedding=await worker.encode_text(body.text, body.model))


@router.post("/caption")
async def caption(worker: WorkerDep, body: CaptionRequest) -> CaptionResponse:
    """Describe a clip (frames + optional transcript), at most 512 new tokens."""
    return CaptionResponse(caption=await worker.caption(body))


@router.post("/generate")
async def generate(worker: WorkerDep, body: GenerateRequestIn) -> GenerateResponse:
    """Free generation from OpenAI-style messages (NER, triples, ...)."""
    return GenerateResponse(text=await worker.generate(body))
