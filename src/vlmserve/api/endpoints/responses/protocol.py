"""`/v1/responses` request shapes: OpenAI's Responses API, with our video parts.

``input`` is a string (one user message) or a list of ``message`` items whose content is a
string or a list of parts: ``input_text``, ``input_image`` (``image_url``: a URL or data URL;
or ``file_id``: an uploaded file of purpose ``vision`` or ``user_data``),
``input_video`` / ``video_url`` (as ``/v1/chat/completions`` takes them), and, in assistant
messages sent back, ``output_text`` / ``refusal``. Items of other types (function calls,
reasoning, item references) and ``input_file`` parts are refused with a 400 that says why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlmserve.api.common.fields import ITEM_FIELDS, RESPONSES_FIELDS, unknown_in_messages
from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.common.text import UnicodeText, valid_unicode
from vlmserve.api.endpoints.chat.protocol import (
    InputVideoPart,
    MediaUuid,
    VideoUrlPart,
    auto_detail,
)

__all__ = [
    "InputFilePart",
    "InputImagePart",
    "InputItem",
    "InputTextPart",
    "OutputTextPart",
    "RefusalPart",
    "ResponsePart",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
]

_INT64 = 2**63 - 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI adds optional fields; none change text


class InputTextPart(_Part):
    type: Literal["input_text"]
    text: UnicodeText


class InputImagePart(_Part):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    uuid: MediaUuid | None = None  # media by reference, as chat's parts

    @field_validator("detail")
    @classmethod
    def _detail(cls, value: str | None) -> str | None:
        return auto_detail(value)


class InputFilePart(_Part):
    """Accepted by the schema so that the 400 can say what to send instead."""

    type: Literal["input_file"]


class OutputTextPart(_Part):
    """An earlier answer sent back as an assistant message."""

    type: Literal["output_text"]
    text: UnicodeText


class RefusalPart(_Part):
    type: Literal["refusal"]
    refusal: UnicodeText


ResponsePart = Annotated[
    InputTextPart
    | InputImagePart
    | InputFilePart
    | OutputTextPart
    | RefusalPart
    | InputVideoPart
    | VideoUrlPart,
    Field(discriminator="type"),
]


class InputItem(BaseModel):
    """A ``message`` item (``type`` may be left out, as in OpenAI's easy input message)."""

    model_config = ConfigDict(extra="allow")  # checked against api/common/fields.py's ITEM_FIELDS
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: UnicodeText | list[ResponsePart]


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (flat: name, schema,
    strict, description), enforced by the grammar engine like chat's ``response_format``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=256)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):  # it would change the answer; no model here has it
            raise ValueError(f"verbosity {value!r} is not served; leave it out or send 'medium'")
        return value


def _item_problem(index: int, item: Any) -> str | None:
    if not isinstance(item, dict):
        return None  # pydantic says what is wrong with it
    kind = item.get("type", "message")
    if kind != "message":
        return (
            f"input[{index}] is a {kind!r} item; this server takes only 'message' items "
            "(role + content), without tools or reasoning items"
        )
    return None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512)
    input: Annotated[UnicodeText | list[InputItem], counted_first(MAX_MESSAGES)]
    instructions: UnicodeText | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    user: str | None = None
    # sampling fields beyond OpenAI's, as /v1/chat/completions takes them (vLLM's extras)
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM's
    include_metrics: bool | None = None  # the response's timings (``api/common/timings.py``)

    @field_validator("input", mode="before")
    @classmethod
    def _message_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("input is empty; send a string or at least one message item")
            for i, item in enumerate(value):
                problem = _item_problem(i, item)
                if problem:
                    raise ValueError(problem)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("metadata holds at most 16 keys of 64 and values of 512 characters")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 16 or any(len(s) > 256 for s in stops)):
            raise ValueError("at most 16 stop strings of at most 256 characters each")
        return [valid_unicode(s) for s in stops] if stops is not None else None

    @property
    def unknown_fields(self) -> list[str]:
        """Fields neither served, nor no-ops, nor refused (``api/common/fields.py``)."""
        return RESPONSES_FIELDS.unknown(self.model_extra or {}) + unknown_in_messages(
            self.item_extras, ITEM_FIELDS, "input"
        )

    @property
    def item_extras(self) -> list[dict[str, Any]]:
        """Each input item's undeclared fields (none for a string input)."""
        items = self.input if isinstance(self.input, list) else []
        return [getattr(item, "model_extra", None) or {} for item in items]
