"""The GPU-worker task API, exact contract: encode-video, encode-text, caption, generate."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.common.text import UnicodeText
from vlmserve.api.endpoints.chat.protocol import ChatMessageIn

__all__ = [
    "CaptionRequest",
    "CaptionResponse",
    "EmbeddingResponse",
    "EncodeTextRequest",
    "EncodeVideoRequest",
    "GenerateRequestIn",
    "GenerateResponse",
]

CAPTION_MAX_TOKENS = 512  # the worker API's "max 512 new tokens"


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, description="Model name; default: by role")


class EncodeVideoRequest(_In):
    frames: list[str] = Field(description="base64-encoded JPEG frames (data URLs also accepted)")


class EncodeTextRequest(_In):
    text: UnicodeText


class EmbeddingResponse(BaseModel):
    embedding: list[float]


class CaptionRequest(_In):
    frames: list[str]
    transcript: UnicodeText | None = Field(default=None, description="audio transcript for context")
    max_new_tokens: int = Field(default=CAPTION_MAX_TOKENS, ge=1, le=CAPTION_MAX_TOKENS)


class CaptionResponse(BaseModel):
    caption: str


class GenerateRequestIn(_In):
    messages: Annotated[list[ChatMessageIn], counted_first(MAX_MESSAGES)] = Field(
        min_length=1, max_length=MAX_MESSAGES
    )
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


class GenerateResponse(BaseModel):
    text: str
