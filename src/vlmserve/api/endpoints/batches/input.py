"""A batch's input file, read as a stream: checked line by line (in a worker thread) keeping
each request's byte offset, and each request read again, alone, when its line runs. Nothing
of the file stays in memory for the batch's life but three machine integers a line, in
arrays: a 50,000-line batch holds 1.2 MB and no object that a full garbage collection walks
(it would pause the event loop for each batch's index while requests wait).

Lines end at ``\\n`` (a ``\\r`` before it is dropped): JSON text may hold any other line
separator (U+2028, U+0085, a form feed) raw inside a string. A UTF-8 byte order mark before
the first line is skipped. A line nested deeper than the JSON reader goes is malformed like
any other (``invalid_json_line`` with its number).

A file whose lines are not all request objects (bad JSON, a missing custom_id, a repeated
one, another url than the batch's endpoint) fails the whole batch before any line runs, with
the line numbers (OpenAI's ``{"code", "message", "param", "line"}``).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from vlmserve.api.routing import strict_loads

__all__ = ["MAX_LINES", "BatchLine", "LineIndex", "LineRequest", "read_request", "scan_input"]

MAX_LINES = 50_000  # OpenAI's limit per batch
_MAX_ERRORS = 20  # line errors listed when a file is refused
_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True, frozen=True)
class BatchLine:
    """Where one request line lies in the input file."""

    line: int  # 1-based line number
    offset: int  # its first byte
    length: int  # its bytes, without the line end


class LineIndex:
    """The request lines of a file in order, kept as three arrays of 64-bit integers."""

    __slots__ = ("_length", "_line", "_offset")

    def __init__(self) -> None:
        self._line, self._offset, self._length = array("q"), array("q"), array("q")

    def append(self, line: int, offset: int, length: int) -> None:
        self._line.append(line)
        self._offset.append(offset)
        self._length.append(length)

    def __len__(self) -> int:
        return len(self._line)

    def __iter__(self) -> Iterator[BatchLine]:
        for line, offset, length in zip(self._line, self._offset, self._length, strict=True):
            yield BatchLine(line, offset, length)


@dataclass(slots=True)
class LineRequest:
    """A request line, read when it runs."""

    line: int
    custom_id: str
    body: Any


def _loads(text: str) -> Any:
    """``strict_loads``, in C where it can: orjson refuses all that it refuses (non-finite
    numbers, deep nesting) and more (a lone surrogate escape), so only what orjson refuses is
    read again by ``strict_loads``, for its verdict and message. It keeps the scan's hold on
    the GIL short."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return strict_loads(text)


def _parse(
    number: int, text: str, endpoint: str
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """(the request object, None) or (None, (code, message)) of a line that is not one."""
    try:
        item = _loads(text)
    except json.JSONDecodeError as exc:
        return None, ("invalid_json_line", f"line {number} is not valid JSON: {exc.msg}")
    except RecursionError:
        return None, (
            "invalid_json_line",
            f"line {number} is not valid JSON: it is nested too deeply",
        )
    if not isinstance(item, dict):
        return None, ("invalid_request", f"line {number} is not a JSON object")
    if not isinstance(item.get("custom_id"), str) or not item["custom_id"]:
        return None, ("missing_custom_id", f"line {number} has no custom_id (a non-empty string)")
    if item.get("method", "POST") != "POST":
        return None, ("invalid_method", f"line {number}: method must be POST")
    if item.get("url") != endpoint:
        return None, (
            "mismatched_url",
            f"line {number}: url {item.get('url')!r} is not the batch's endpoint {endpoint!r}",
        )
    return item, None


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\n").removesuffix(b"\r").decode("utf-8", "replace")


def scan_input(path: Path, endpoint: str) -> tuple[LineIndex, list[dict[str, Any]]]:
    """The request lines of an input file, or (when any is malformed) the errors. Blocking:
    run it in a worker thread."""
    lines = LineIndex()
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):  # binary lines end at b"\n" only
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(_BOM):
                raw, start = raw[len(_BOM) :], start + len(_BOM)
            text = _text(raw)
            if not text.strip():
                continue
            item, problem = _parse(number, text, endpoint)
            if item is not None and item["custom_id"] in seen:
                message = f"line {number}: custom_id {item['custom_id']!r} is used twice"
                problem = "duplicate_custom_id", message
            elif item is not None:
                seen.add(item["custom_id"])
                lines.append(number, start, len(raw.rstrip(b"\n")))
            if problem is not None and len(errors) < _MAX_ERRORS:
                errors.append(
                    {"code": problem[0], "message": problem[1], "param": None, "line": number}
                )
    if not errors and not lines:
        errors.append(
            {
                "code": "empty_file",
                "message": "the input file has no request lines",
                "param": None,
                "line": None,
            }
        )
    if not errors and len(lines) > MAX_LINES:
        errors.append(
            {
                "code": "too_many_requests",
                "message": f"the input file has "
                f"{len(lines)} lines; a batch holds at most {MAX_LINES}",
                "param": None,
                "line": None,
            }
        )
    return lines, errors


def read_request(path: Path, line: BatchLine) -> LineRequest:
    """The request of one checked line, read from the file again. Blocking."""
    with path.open("rb") as f:
        f.seek(line.offset)
        raw = f.read(line.length)
    item = _loads(_text(raw))
    return LineRequest(line.line, item["custom_id"], item.get("body"))
