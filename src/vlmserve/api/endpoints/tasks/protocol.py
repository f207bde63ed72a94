"""Wire shapes of the task endpoints: ``/v1/extract/{entities,triples,id-card}``.

Each request takes its input (``text``, ``images``, ``video`` or ``frames``; an ``image`` for
ID cards), an optional ``model`` (default: the model with role ``extract``, else ``chat``),
``max_tokens``, ``temperature`` (default 0) and ``schema``: a caller's JSON schema that
replaces the built-in one. Responses are plain dicts built by ``api/endpoints/tasks/service.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlmserve.api.common.text import UnicodeText
from vlmserve.tasks import check_schema

__all__ = [
    "EntitiesRequest",
    "ExtractRequest",
    "IdCardRequest",
    "IdCardValidateRequest",
    "TaskOptions",
    "TriplesRequest",
]


class TaskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Model name, alias or role:<role>; default: role extract, else chat",
    )
    max_tokens: int | None = Field(default=None, ge=1, description="default: the task's budget")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    json_schema: dict[str, Any] | None = Field(
        default=None,
        alias="schema",
        description="A JSON schema (type object) that replaces the built-in one; the answer "
        "comes back under `result`",
    )

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_schema(value)


class ExtractRequest(TaskOptions):
    text: UnicodeText | None = Field(default=None, max_length=200_000)
    images: list[str] = Field(default_factory=list, description="image URLs or data URLs")
    video: str | None = Field(default=None, description="a video URL or data URL")
    frames: list[str] | None = Field(
        default=None, description="a clip as base64 JPEG frames (the /encode-video form)"
    )
    max_items: int | None = Field(
        default=None, ge=1, le=256, description="at most this many items (default 32)"
    )


class EntitiesRequest(ExtractRequest):
    entity_types: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="restrict `type` to these (default: PERSON, ORGANIZATION, LOCATION, ...)",
    )

    @field_validator("entity_types")
    @classmethod
    def _types(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        types = [t.strip() for t in value]
        if any(not t or len(t) > 64 for t in types):
            raise ValueError("entity types must be non-empty and at most 64 characters")
        if len(set(types)) != len(types):
            raise ValueError("entity types must be unique")
        return types


class TriplesRequest(ExtractRequest):
    pass


class IdCardRequest(TaskOptions):
    image: str = Field(min_length=1, description="the card photo: URL, data URL or base64")


class IdCardValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fields: dict[str, Any] = Field(description="KTP field values to check, as /ktp-ocr/ names them")
