"""``input_image`` parts that name an uploaded file (``file_id``) instead of a URL.

The file must be the caller's (another key's file is a 404, as an unknown one), uploaded with
purpose ``vision`` or ``user_data``, and hold an image. Its bytes become a data URL on the part,
so the media pipeline applies the same limits (bytes, pixels) as to any other image, and a
stored response continues after a restart even if the file was deleted meanwhile.

Limits come before any read: the media parts are counted (references included) against
``max_media_per_request`` and every referenced file is sized from its stored row against
``max_media_bytes``; then each distinct file is read once, however often it is named.
"""

from __future__ import annotations

import asyncio
import mimetypes
from dataclasses import dataclass

from vlmserve.api.endpoints.chat.protocol import InputVideoPart, VideoUrlPart
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.api.endpoints.files.store import FileRow
from vlmserve.api.endpoints.responses.protocol import InputImagePart, ResponsesRequest
from vlmserve.errors import InvalidRequest, PayloadTooLarge
from vlmserve.media.encode import data_url

__all__ = ["IMAGE_PURPOSES", "MediaLimits", "attach_files", "image_mime"]

IMAGE_PURPOSES = ("vision", "user_data")
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_mime(head: bytes, filename: str) -> str | None:
    """The image type of a file, from its first bytes (else its name); None: not an image."""
    for magic, mime in _MAGIC:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    guessed = mimetypes.guess_type(filename)[0]
    return guessed if guessed and guessed.startswith("image/") else None


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_items: int  # media parts per request (VLMSERVE_MAX_MEDIA_PER_REQUEST)
    max_bytes: int  # bytes per media item (VLMSERVE_MAX_MEDIA_BYTES)


_Ref = tuple[int, int, InputImagePart]  # message index, part index, the part


def _media_parts(body: ResponsesRequest) -> tuple[int, list[_Ref]]:
    """(media parts in the input, the ``input_image`` parts that only name a file)."""
    count, refs = 0, []
    for i, item in enumerate(body.input if not isinstance(body.input, str) else []):
        for j, part in enumerate(item.content if not isinstance(item.content, str) else []):
            if isinstance(part, InputImagePart | InputVideoPart | VideoUrlPart):
                count += 1
            if isinstance(part, InputImagePart) and not part.image_url and part.file_id:
                refs.append((i, j, part))
    return count, refs


def _check_count(count: int, limits: MediaLimits) -> None:
    if count > limits.max_items:
        raise InvalidRequest(
            f"{count} media items in one request (file references included); the limit is "
            f"{limits.max_items} (VLMSERVE_MAX_MEDIA_PER_REQUEST)",
            param="input",
            code="too_many_media_items",
        )


def _checked_row(
    files: FilesService, owner: str, file_id: str, where: str, limits: MediaLimits
) -> FileRow:
    """The file's row once it passed every check that reads no byte of it."""
    row = files.get(owner, file_id, param=where)
    if row.purpose not in IMAGE_PURPOSES:
        raise InvalidRequest(
            f"file {file_id!r} has purpose {row.purpose!r}; an input_image file is uploaded "
            f"with purpose {' or '.join(repr(p) for p in IMAGE_PURPOSES)}",
            param=where,
        )
    if row.bytes > limits.max_bytes:
        raise PayloadTooLarge(
            f"file {file_id!r} is {row.bytes} bytes; the limit is {limits.max_bytes} bytes per "
            "media item (VLMSERVE_MAX_MEDIA_BYTES)",
            param=where,
        )
    return row


async def _file_url(files: FilesService, row: FileRow, where: str) -> str:
    data = await asyncio.to_thread(files.store.blob(row.id).read_bytes)
    mime = image_mime(data[:16], row.filename)
    if mime is None:
        raise InvalidRequest(
            f"file {row.id!r} ({row.filename!r}) is not an image (PNG, JPEG, GIF, WebP or BMP)",
            param=where,
        )
    return data_url(data, mime)


async def attach_files(
    body: ResponsesRequest, owner: str, files: FilesService | None, limits: MediaLimits
) -> list[list[int | str]]:
    """Give every ``input_image`` with only a ``file_id`` the file's data URL (in place);
    returns ``[message index, part index, file_id]`` of each, for ``input_items``."""
    count, refs = _media_parts(body)
    _check_count(count, limits)
    if not refs:
        return []
    if files is None:
        i, j, _ = refs[0]
        raise InvalidRequest(
            "input_image file_id needs the Files API, which is not set up here; send image_url",
            param=f"input[{i}].content[{j}]",
        )
    rows: dict[str, tuple[FileRow, str]] = {}
    for i, j, part in refs:
        file_id, where = str(part.file_id), f"input[{i}].content[{j}]"
        if file_id not in rows:
            rows[file_id] = (_checked_row(files, owner, file_id, where, limits), where)
    urls = {file_id: await _file_url(files, row, where) for file_id, (row, where) in rows.items()}
    for _, _, part in refs:
        part.image_url = urls[str(part.file_id)]
    return [[i, j, str(part.file_id)] for i, j, part in refs]
