"""``/v1/gateway/*`` request shapes: what a worker sends to join or leave a gateway."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DeregisterRequest", "RegisterRequest"]


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    url: str = Field(min_length=1, max_length=2048)
    instance: str = Field(min_length=1, max_length=256)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must be the worker's base URL, http(s)://host:port")
        return url


class DeregisterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    instance: str = Field(min_length=1, max_length=256)
    reason: str | None = Field(default=None, max_length=256)
