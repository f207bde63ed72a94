"""``input_image`` parts that name an uploaded file (``file_id``) instead of a URL.

The file must be the caller's (another key's file is a 404, as an unknown one), uploaded with
purpose ``vision`` or ``user_data``, and hold an image. Its bytes become a data URL on the part,
so the media pipeline applies the same limits (bytes, pixels) as to any other image, and a
stored response continues after a restart even if the file was deleted meanwhile.
"""

from __future__ import annotations

import asyncio
import mimetypes

from vlmserve.api.protocol.responses_api import InputImagePart, ResponsesRequest
from vlmserve.api.serving.files import FilesService
from vlmserve.errors import InvalidRequest
from vlmserve.media.encode import data_url

__all__ = ["IMAGE_PURPOSES", "attach_files", "image_mime"]

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


async def _file_url(files: FilesService, owner: str, file_id: str, where: str) -> str:
    row = files.get(owner, file_id, param=where)
    if row.purpose not in IMAGE_PURPOSES:
        raise InvalidRequest(
            f"file {file_id!r} has purpose {row.purpose!r}; an input_image file is uploaded "
            f"with purpose {' or '.join(repr(p) for p in IMAGE_PURPOSES)}", param=where,
        )  # fmt: skip
    data = await asyncio.to_thread(files.store.blob(file_id).read_bytes)
    mime = image_mime(data[:16], row.filename)
    if mime is None:
        raise InvalidRequest(f"file {file_id!r} ({row.filename!r}) is not an image (PNG, JPEG, "
                             "GIF, WebP or BMP)", param=where)  # fmt: skip
    return data_url(data, mime)


async def attach_files(body: ResponsesRequest, owner: str, files: FilesService | None
                       ) -> list[list[int | str]]:  # fmt: skip
    """Give every ``input_image`` with only a ``file_id`` the file's data URL (in place);
    returns ``[message index, part index, file_id]`` of each, for ``input_items``."""
    found: list[list[int | str]] = []
    if isinstance(body.input, str):
        return found
    for i, item in enumerate(body.input):
        if isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if not isinstance(part, InputImagePart) or part.image_url or not part.file_id:
                continue
            where = f"input[{i}].content[{j}]"
            if files is None:
                raise InvalidRequest("input_image file_id needs the Files API, which is not "
                                     "set up here; send image_url", param=where)  # fmt: skip
            part.image_url = await _file_url(files, owner, part.file_id, where)
            found.append([i, j, part.file_id])
    return found
