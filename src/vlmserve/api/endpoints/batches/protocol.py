"""``/v1/batches`` wire shapes (OpenAI's ``batch`` object); the work is
``service.py`` beside it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

__all__ = ["BatchCreate", "BatchList", "BatchObject", "RequestCounts"]

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Endpoint = Literal["/v1/chat/completions", "/v1/responses", "/v1/embeddings"]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Endpoint
    completion_window: Literal["24h"] = "24h"
    # OpenAI: at most 16 pairs, keys up to 64 characters, values up to 512
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None  # {"object": "list", "data": [{code, message, line}]}
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, Any] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
