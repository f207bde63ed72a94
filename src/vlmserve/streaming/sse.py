"""Server-Sent Events wire format: encode events, parse ``Last-Event-ID`` values.

id: <session_id>:<index>
event: <type>            (only when the event has a type)
data: <line 1>
data: <line 2>           (one data line per line of the payload)
<blank line>
"""

from __future__ import annotations

import re

from vlmserve.errors import InvalidRequest
from vlmserve.streaming.events import Event

__all__ = [
    "MAX_SESSION_ID_LENGTH",
    "encode_comment",
    "encode_event",
    "format_event_id",
    "parse_event_id",
    "validate_session_id",
]

MAX_SESSION_ID_LENGTH = 256
# Printable ASCII without whitespace: a session id goes into an `id:` line and a store key.
_SESSION_ID = re.compile(r"[\x21-\x7e]+")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def validate_session_id(session_id: str, *, param: str = "session_id") -> str:
    """Return ``session_id`` or raise InvalidRequest saying what a valid one looks like."""
    if (
        not isinstance(session_id, str)
        or not 0 < len(session_id) <= MAX_SESSION_ID_LENGTH
        or not _SESSION_ID.fullmatch(session_id)
    ):
        raise InvalidRequest(
            f"invalid session id {session_id!r}: use 1 to {MAX_SESSION_ID_LENGTH} printable ASCII "
            "characters without spaces (for example a UUID)",
            param=param,
            code="invalid_session_id",
        )
    return session_id


def format_event_id(session_id: str, index: int) -> str:
    return f"{session_id}:{index}"


def encode_event(session_id: str, event: Event) -> bytes:
    """One SSE message; multi-line data becomes several ``data:`` lines."""
    lines = [f"id: {format_event_id(session_id, event.index)}"]
    if event.event:
        lines.append(f"event: {event.event}")
    lines.extend(f"data: {line}" for line in _LINE_BREAK.split(event.data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def encode_comment(text: str = "") -> bytes:
    """An SSE comment line (clients ignore it); useful as a keep-alive."""
    return "".join(f": {line}\n" for line in _LINE_BREAK.split(text)).encode("utf-8") + b"\n"


def parse_event_id(value: str) -> tuple[str, int]:
    """Split ``<session_id>:<index>`` on the last ``:``; anything else raises InvalidRequest."""
    text = value.strip() if isinstance(value, str) else ""
    session_id, sep, index = text.rpartition(":")
    if not sep or not index.isascii() or not index.isdigit() or len(index) > 18:
        raise InvalidRequest(
            f"invalid Last-Event-ID {value!r}: expected '<session_id>:<index>' as sent in the "
            "`id:` line of an event, for example 'abc123:41'",
            param="Last-Event-ID",
            code="invalid_last_event_id",
        )
    validate_session_id(session_id, param="Last-Event-ID")
    return session_id, int(index)
