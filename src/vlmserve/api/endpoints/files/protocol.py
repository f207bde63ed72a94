"""``/v1/files`` wire shapes (OpenAI's ``file`` object); the work is ``service.py`` beside it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

__all__ = ["FileDeleted", "FileList", "FileObject"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str  # batch | vision | user_data; batch_output for a batch's results
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool
