"""OpenAI's Files API: uploads kept under ``files_dir``, each owned by the API key that sent it.

An upload streams to disk under ``files_max_bytes`` and the owner's ``files_quota_bytes``
(both checked from ``Content-Length`` before a byte is read, then while it streams). Files
expire ``files_ttl_seconds`` after they were made (OpenAI's ``expires_at``); expired files and
finished batches are swept on uploads and every few minutes. Another key's file is a 404, as an
unknown one is: nobody learns which ids exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from python_multipart.exceptions import MultipartParseError

from vlmserve.api.endpoints.files.store import FileRow, FilesStore
from vlmserve.api.endpoints.files.upload import FORM_OVERHEAD, receive_upload
from vlmserve.config import Settings
from vlmserve.errors import InvalidRequest, NotFound, PayloadTooLarge

__all__ = ["PURPOSES", "FilesService", "new_file_id"]

log = logging.getLogger(__name__)

PURPOSES = ("batch", "vision", "user_data")  # what clients upload; batch results: batch_output


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class FilesService:
    def __init__(self, store: FilesStore, *, max_bytes: int, quota_bytes: int, ttl: float):
        self.store = store
        self.max_bytes = max_bytes
        self.quota_bytes = quota_bytes  # 0: no quota
        self.ttl = ttl  # 0: files are kept until deleted
        self._pending: dict[str, int] = {}  # bytes of uploads in flight, by owner

    @classmethod
    def from_settings(cls, settings: Settings) -> FilesService:
        return cls(
            FilesStore(settings.files_path),
            max_bytes=settings.files_max_bytes,
            quota_bytes=settings.files_quota_bytes,
            ttl=settings.files_ttl_seconds,
        )

    def expires_at(self, now: int) -> int | None:
        return now + int(self.ttl) if self.ttl else None

    # -- limits -----------------------------------------------------------------------------

    def _too_large(self) -> str:
        return (
            f"the file is larger than {self.max_bytes} bytes (VLMSERVE_FILES_MAX_BYTES); "
            "split it into smaller files"
        )

    def used(self, owner: str) -> int:
        """Bytes the owner stores or is uploading now (``used_bytes`` and the uploads in
        flight)."""
        return self.store.used_bytes(owner) + self._pending.get(owner, 0)

    def _over_quota(self, owner: str, adding: int, used: int | None = None) -> PayloadTooLarge:
        used = self.used(owner) if used is None else used
        return PayloadTooLarge(
            f"this upload ({_mib(adding)}) would take this API key's stored data (files, batch "
            f"results and uploads in progress) to {_mib(used + adding)}, over its quota of "
            f"{_mib(self.quota_bytes)} (VLMSERVE_FILES_QUOTA_BYTES); delete files "
            "(DELETE /v1/files/{id}) first",
            param="file",
            code="files_quota_exceeded",
        )

    def check_length(self, owner: str, content_length: str | None) -> None:
        """Refuse by the declared length, before a byte is read."""
        if content_length is None or not content_length.isdigit():
            return
        declared = int(content_length) - FORM_OVERHEAD
        if declared > self.max_bytes:
            raise PayloadTooLarge(self._too_large(), param="file")
        if self.quota_bytes and self.used(owner) + declared > self.quota_bytes:
            raise self._over_quota(owner, declared)

    def check_room(self, owner: str) -> None:
        """Refuse new work that stores results when the owner's quota is used up."""
        used = self.used(owner)
        if self.quota_bytes and used >= self.quota_bytes:
            raise InvalidRequest(
                f"this API key stores {_mib(used)} (files and batch results), its whole quota "
                f"of {_mib(self.quota_bytes)} (VLMSERVE_FILES_QUOTA_BYTES); delete files "
                "(DELETE /v1/files/{id}) first",
                code="files_quota_exceeded",
            )

    def _charger(self, owner: str) -> tuple[Callable[[int], None], Callable[[], None]]:
        """(charge, release) of one upload. ``charge(n)`` refuses the next ``n`` bytes over the
        size limit or the quota, else holds them as pending. The check and the hold run on the
        event loop with no await between them, and a finished upload's row is added before its
        hold is released, so concurrent uploads of one key cannot pass the quota together."""
        held = 0
        results = 0  # bytes of the owner's unfinished batch results, read once
        if self.quota_bytes:
            results = self.store.used_bytes(owner) - self.store.file_bytes(owner)

        def charge(n: int) -> None:
            nonlocal held
            if held + n > self.max_bytes:
                raise PayloadTooLarge(self._too_large(), param="file")
            if self.quota_bytes:
                used = self.store.file_bytes(owner) + results + self._pending.get(owner, 0)
                if used + n > self.quota_bytes:
                    raise self._over_quota(owner, held + n, used - held)
            held += n
            self._pending[owner] = self._pending.get(owner, 0) + n

        def release() -> None:
            left = self._pending.get(owner, 0) - held
            if left > 0:
                self._pending[owner] = left
            else:
                self._pending.pop(owner, None)

        return charge, release

    # -- create -----------------------------------------------------------------------------

    async def upload(
        self,
        owner: str,
        content_type: str | None,
        content_length: str | None,
        body: AsyncIterator[bytes],
    ) -> dict[str, Any]:
        self.sweep()
        self.check_length(owner, content_length)
        file_id = new_file_id()
        part = self.store.blob(file_id).with_suffix(".part")
        self.store.db()  # makes the directories
        charge, release = self._charger(owner)
        try:
            try:
                upload = await receive_upload(content_type, body, part, charge)
            except MultipartParseError as exc:
                raise InvalidRequest(f"the multipart form cannot be read: {exc}") from None
            purpose = upload.fields.get("purpose", "")
            if purpose not in PURPOSES:
                part.unlink(missing_ok=True)
                raise InvalidRequest(
                    f"purpose {purpose!r} is not one of {', '.join(PURPOSES)}", param="purpose"
                )
            part.rename(self.store.blob(file_id))
            return self._add(owner, file_id, upload.filename, purpose, upload.bytes).to_wire()
        finally:
            release()  # after the row is added: no await between them

    def _add(self, owner: str, file_id: str, filename: str, purpose: str, size: int) -> FileRow:
        now = int(time.time())
        row = FileRow(file_id, owner, filename, purpose, size, now, self.expires_at(now))
        self.store.add_file(row)
        return row

    async def write_results(
        self, owner: str, file_id: str, filename: str, batch_id: str, ok: bool
    ) -> bool:
        """A file the server makes from a batch's stored output (``ok``) or error lines: JSONL,
        purpose batch_output, written row by row in a worker thread; False when there are no
        such lines. It counts towards the owner's quota but is always written."""
        path = self.store.blob(file_id)
        part = path.with_suffix(".part")
        self.store.db()
        size = await asyncio.to_thread(self.store.dump_lines, batch_id, ok, part)
        if not size:
            part.unlink(missing_ok=True)
            return False
        part.rename(path)
        self._add(owner, file_id, filename, "batch_output", size)
        return True

    # -- read, delete -----------------------------------------------------------------------

    def get(self, owner: str, file_id: str, param: str | None = None) -> FileRow:
        row = self.store.file(owner, file_id) if len(file_id) <= 128 else None
        if row is None:
            raise NotFound(
                f"no file {file_id!r} (unknown, deleted, expired, or another API key's)",
                param=param,
                code="file_not_found",
            )
        return row

    def retrieve(self, owner: str, file_id: str) -> dict[str, Any]:
        return self.get(owner, file_id).to_wire()

    def path(self, owner: str, file_id: str) -> Path:
        self.get(owner, file_id)
        return self.store.blob(file_id)

    def read_text(self, owner: str, file_id: str, param: str | None = None) -> str:
        self.get(owner, file_id, param)
        return self.store.blob(file_id).read_text("utf-8", errors="replace")

    def list(
        self, owner: str, purpose: str | None, limit: int, after: str | None, order: str
    ) -> dict[str, Any]:
        rows = self.store.files(owner, purpose, limit + 1, after, order == "desc")
        data = [r.to_wire() for r in rows[:limit]]
        return {
            "object": "list",
            "data": data,
            "has_more": len(rows) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        self.get(owner, file_id)
        self.store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def sweep(self) -> None:
        """Delete what has outlived ``files_ttl_seconds``."""
        if not self.ttl:
            return
        files, batches = self.store.expired(time.time())
        for file_id in files:
            with contextlib.suppress(OSError):
                self.store.delete_file(file_id)
        for batch_id in batches:
            self.store.delete_batch(batch_id)
        if files or batches:
            log.info("retention: deleted %d files and %d batches", len(files), len(batches))
