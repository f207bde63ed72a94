"""``/v1/embeddings``: OpenAI's text form (strings, or token arrays as vLLM takes them), plus
vLLM's ``messages`` form for images and video."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.common.text import UnicodeText
from vlmserve.api.endpoints.chat.protocol import ChatMessageIn

__all__ = ["EmbeddingsRequest", "TokenIds"]

# Token ids of the *served model's* tokenizer (vLLM's reading of OpenAI's token-array input).
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=131072)]


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=512)
    input: UnicodeText | list[UnicodeText] | TokenIds | list[TokenIds] | None = None
    messages: Annotated[list[ChatMessageIn] | None, counted_first(MAX_MESSAGES)] = Field(
        default=None, min_length=1, max_length=MAX_MESSAGES
    )
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
    def token_arrays(self) -> list[list[int]] | None:
        """The input as token arrays (``[1, 2]`` or ``[[1, 2], [3]]``), or None for text."""
        if not isinstance(self.input, list) or isinstance(self.input[0], str):
            return None
        if isinstance(self.input[0], int):
            return [self.input]
        return self.input

    @property
    def texts(self) -> list[str]:
        """The input as strings (empty when it is token arrays)."""
        if isinstance(self.input, str):
            return [self.input]
        if self.token_arrays is not None:
            return []
        return list(self.input or [])  # type: ignore[arg-type]
