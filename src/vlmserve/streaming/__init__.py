"""Resumable SSE sessions, independent of any model backend (no torch, no web framework).

A producer yields ``Emit`` values; ``SessionManager.start`` numbers them into ``Event`` values
(SSE id ``<session_id>:<index>``), persists them in a ``SessionStore`` and keeps the newest in a
ring buffer; ``SessionManager.listen`` replays and follows them; ``sse.encode_event`` writes them.
"""

from vlmserve.streaming.events import (
    DONE,
    FINAL_STATES,
    Emit,
    Event,
    OnCancel,
    OnError,
    Resumer,
    Resumption,
    SessionRecord,
    SessionState,
    error_emit,
    error_event,
    gap_event,
)
from vlmserve.streaming.manager import Listener, SessionManager
from vlmserve.streaming.session import Session, SessionOptions
from vlmserve.streaming.sse import (
    encode_comment,
    encode_event,
    format_event_id,
    parse_event_id,
    validate_session_id,
)
from vlmserve.streaming.store import (
    MemoryStore,
    RedisStore,
    SessionStore,
    SQLiteStore,
    build_store,
)

__all__ = [
    "DONE",
    "FINAL_STATES",
    "Emit",
    "Event",
    "Listener",
    "MemoryStore",
    "OnCancel",
    "OnError",
    "RedisStore",
    "Resumer",
    "Resumption",
    "SQLiteStore",
    "Session",
    "SessionManager",
    "SessionOptions",
    "SessionRecord",
    "SessionState",
    "SessionStore",
    "build_store",
    "encode_comment",
    "encode_event",
    "error_emit",
    "error_event",
    "format_event_id",
    "gap_event",
    "parse_event_id",
    "validate_session_id",
]
