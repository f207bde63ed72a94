"""Server-Sent Events wire format: encode events, parse ``Last-Event-ID`` values.

Two wires carry the same events, one SSE message per event, in the same order:

OpenAI wire (the default; what OpenAI and vLLM send, what every client parses):
    data: <line 1>
    data: <line 2>           (one data line per line of the payload)
    <blank line>

Resumable wire (clients that ask for it, see ``vlmserve.api.common.sse``):
    id: <session_id>:<index>
    event: <type>            (only when the event has a type, i.e. ``error``)
    data: <line 1>
    <blank line>

An event's index is its position in the session: 0 for the first, one more for each next one.
Every event counts once, whatever it holds: a content chunk (the first carries the role with
the first token; several tokens grouped by ``stream_interval`` are one event), the finish
chunk, the usage chunk, an error event and the terminal ``[DONE]``. So on the OpenAI wire the
index of a message is the number of messages received before it, and a client that received k
messages resumes with ``Last-Event-ID: <X-Session-ID>:<k-1>``.
"""

from __future__ import annotations

import re

from vlmserve.errors import InvalidRequest
from vlmserve.streaming.events import Event

__all__ = [
    "MAX_SESSION_ID_LENGTH",
    "encode_comment",
    "encode_data",
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


def _data_lines(data: str) -> list[str]:
    return [f"data: {line}" for line in _LINE_BREAK.split(data)]


def encode_event(session_id: str, event: Event) -> bytes:
    """One SSE message of the resumable wire: ``id:``, ``event:`` (if typed), ``data:`` lines."""
    lines = [f"id: {format_event_id(session_id, event.index)}"]
    if event.event:
        lines.append(f"event: {event.event}")
    lines.extend(_data_lines(event.data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def encode_data(event: Event) -> bytes:
    """One SSE message of the OpenAI wire: ``data:`` lines only. An error event is told apart
    by its payload, ``{"error": {...}}``, as OpenAI and vLLM send it."""
    return ("\n".join(_data_lines(event.data)) + "\n\n").encode("utf-8")


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
