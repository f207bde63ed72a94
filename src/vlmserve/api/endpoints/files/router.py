"""OpenAI's Files API: ``/v1/files`` upload, list, retrieve, delete, content. The work is
``vlmserve.api.endpoints.files.service``; every call sees only the caller's own files."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from vlmserve.api.endpoints.files.protocol import FileDeleted, FileList, FileObject
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import FilesDep, OwnerDep

router = APIRouter(tags=["files"], route_class=StrictJSONRoute)

_UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch", "vision", "user_data"]},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=_UPLOAD_FORM)
async def upload_file(request: Request, files: FilesDep, owner: OwnerDep) -> FileObject:
    """Upload a file (multipart ``file`` + ``purpose``), up to VLMSERVE_FILES_MAX_BYTES and the
    key's VLMSERVE_FILES_QUOTA_BYTES: over either is a 413 before the file is stored."""
    headers = request.headers
    made = await files.upload(
        owner, headers.get("content-type"), headers.get("content-length"), request.stream()
    )
    return FileObject.model_validate(made)


@router.get("/v1/files")
async def list_files(
    files: FilesDep,
    owner: OwnerDep,
    purpose: str | None = Query(default=None, max_length=64),
    limit: int = Query(default=10000, ge=1, le=10000),
    after: str | None = Query(default=None, max_length=128),
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """The caller's files, newest first (``order=asc`` for oldest first)."""
    return FileList.model_validate(files.list(owner, purpose, limit, after, order))


@router.get("/v1/files/{file_id}")
async def retrieve_file(files: FilesDep, owner: OwnerDep, file_id: str) -> FileObject:
    return FileObject.model_validate(files.retrieve(owner, file_id))


@router.delete("/v1/files/{file_id}")
async def delete_file(files: FilesDep, owner: OwnerDep, file_id: str) -> FileDeleted:
    return FileDeleted.model_validate(files.delete(owner, file_id))


@router.get("/v1/files/{file_id}/content", response_model=None)
async def file_content(files: FilesDep, owner: OwnerDep, file_id: str) -> Any:
    """The file's bytes as uploaded (a batch's output and error files: JSONL), as a download:
    never rendered or sniffed by a browser as a page of this origin."""
    row = files.get(owner, file_id)
    return FileResponse(
        files.store.blob(row.id),
        media_type="application/octet-stream",
        filename=row.filename,
        content_disposition_type="attachment",
        headers={"X-Content-Type-Options": "nosniff"},
    )
