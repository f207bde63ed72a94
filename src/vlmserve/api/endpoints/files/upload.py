"""``multipart/form-data`` uploads read as a stream, straight to disk, under a byte limit.

Starlette's ``request.form()`` spools the whole body before a route sees it; an upload here is
refused by its ``Content-Length`` before a byte is read, and otherwise as soon as the file part
passes a limit while it streams into ``<id>.part`` (deleted on any failure): each piece of the
file is offered to ``charge`` before it is written, which raises to refuse it. A form that ends
before its closing boundary (a cut-off upload) is refused, never stored as a complete file.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from python_multipart.multipart import MultipartParser, parse_options_header

from vlmserve.errors import InvalidRequest
from vlmserve.private import open_private

__all__ = ["FORM_OVERHEAD", "Upload", "receive_upload"]

FORM_OVERHEAD = 64 * 1024  # multipart boundaries, part headers and the small form fields
_MAX_FIELD = 1024  # bytes of a form field other than the file


@dataclass(slots=True)
class Upload:
    filename: str = ""
    bytes: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    has_file: bool = False


@dataclass(slots=True)
class _Reader:
    """The parser's callbacks: the ``file`` part goes to ``out``, other parts to fields."""

    out: IO[bytes]
    charge: Callable[[int], None]  # raises to refuse the next n bytes of the file
    upload: Upload = field(default_factory=Upload)
    ended: bool = False  # the closing boundary was read
    header_name: bytes = b""
    header_value: bytes = b""
    disposition: dict[bytes, bytes] = field(default_factory=dict)
    value: bytearray = field(default_factory=bytearray)

    def on_part_begin(self) -> None:
        self.disposition, self.value = {}, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = parse_options_header(self.header_value)[1]
        self.header_name, self.header_value = b"", b""

    def _is_file(self) -> bool:
        return self.disposition.get(b"name") == b"file"

    def on_headers_finished(self) -> None:
        if self._is_file():
            if self.upload.has_file:
                raise InvalidRequest("send one file per upload", param="file")
            self.upload.has_file = True
            name = self.disposition.get(b"filename", b"upload").decode("utf-8", "replace")
            self.upload.filename = Path(name.replace("\\", "/")).name[:255] or "upload"

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file():
            self.charge(end - start)
            self.upload.bytes += end - start
            self.out.write(data[start:end])
            return
        self.value += data[start:end]
        if len(self.value) > _MAX_FIELD:
            raise InvalidRequest("a form field other than file is over 1 KiB")

    def on_end(self) -> None:
        self.ended = True

    def on_part_end(self) -> None:
        name = self.disposition.get(b"name")
        if name and not self._is_file():
            self.upload.fields[name.decode("utf-8", "replace")] = self.value.decode(
                "utf-8", "replace"
            )


def _boundary(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "upload a file as multipart/form-data with the fields 'file' and 'purpose'",
            code="invalid_content_type",
        )
    return boundary


async def receive_upload(
    content_type: str | None,
    body: AsyncIterator[bytes],
    dest: Path,
    charge: Callable[[int], None],
) -> Upload:
    """Stream the form into ``dest`` (the ``file`` part's bytes), each piece offered to
    ``charge`` first (which raises to refuse it). ``dest`` is removed unless this returns."""
    boundary = _boundary(content_type)
    ok = False
    try:
        with open_private(dest) as out:
            reader = _Reader(out, charge)
            parser = MultipartParser(
                boundary,
                {
                    "on_part_begin": reader.on_part_begin,
                    "on_part_data": reader.on_part_data,
                    "on_part_end": reader.on_part_end,
                    "on_header_field": reader.on_header_field,
                    "on_header_value": reader.on_header_value,
                    "on_header_end": reader.on_header_end,
                    "on_headers_finished": reader.on_headers_finished,
                    "on_end": reader.on_end,
                },
            )  # type: ignore[arg-type]
            async for chunk in body:
                parser.write(chunk)
            parser.finalize()
        if not reader.ended:
            raise InvalidRequest(
                "the upload ended before the form's closing boundary (cut off?); send it again",
                code="incomplete_upload",
            )
        if not reader.upload.has_file:
            raise InvalidRequest("the form has no 'file' field", param="file")
        ok = True
        return reader.upload
    finally:
        if not ok:
            with contextlib.suppress(OSError):
                dest.unlink()
