"""``/tokenize`` and ``/detokenize`` request shapes, as vLLM's (chat ``messages`` or ``prompt``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.common.text import UnicodeText
from vlmserve.api.endpoints.chat.protocol import ChatMessageIn

__all__ = ["DetokenizeRequest", "TokenizeRequest"]


class TokenizeRequest(BaseModel):
    """``messages`` (with images and video, as a chat completion takes them; the count is that
    request's ``usage.prompt_tokens``) or a plain ``prompt``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, min_length=1, max_length=512)
    prompt: UnicodeText | None = None
    messages: Annotated[list[ChatMessageIn] | None, counted_first(MAX_MESSAGES)] = Field(
        default=None, min_length=1, max_length=MAX_MESSAGES
    )
    # vLLM's default: true for a prompt, false for messages (the chat template adds its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # as a chat completion's
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either messages (a chat) or prompt (plain text), not both")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, min_length=1, max_length=512)
    tokens: list[int] = Field(max_length=1_000_000)
