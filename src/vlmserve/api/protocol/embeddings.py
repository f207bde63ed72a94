"""``/v1/embeddings``: OpenAI's text form, plus vLLM's ``messages`` form for images and video."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.api.protocol.chat import ChatMessageIn
from vlmserve.api.protocol.text import UnicodeText

__all__ = ["EmbeddingsRequest"]


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=512)
    input: UnicodeText | list[UnicodeText] | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="after")
    def _one_form(self) -> EmbeddingsRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of `input` (text) or `messages` (multimodal)")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("`input` is an empty list")
        return self

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input or [])
