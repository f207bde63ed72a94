"""``POST /tokenize`` and ``POST /detokenize``, vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from vlmserve.api.endpoints.tokenize import service as serving
from vlmserve.api.endpoints.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import ServicesDep

router = APIRouter(tags=["tokenize"], route_class=StrictJSONRoute)


@router.post("/tokenize")
async def tokenize(services: ServicesDep, body: TokenizeRequest) -> dict[str, Any]:
    """A chat's prompt tokens (``messages`` with images and video: ``count`` is the
    ``usage.prompt_tokens`` of the same chat request) or a plain ``prompt``'s."""
    strict = services.settings.strict_fields
    return await serving.tokenize(services.models, services.chat.converter, body, strict=strict)


@router.post("/detokenize")
async def detokenize(services: ServicesDep, body: DetokenizeRequest) -> dict[str, Any]:
    """The text of token ids of the model's tokenizer."""
    return await serving.detokenize(services.models, body)
