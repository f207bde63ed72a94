"""uvicorn's httptools protocol with a cap on the request head, in bytes and in time.

uvicorn's ``h11`` protocol caps the request head (``h11_max_incomplete_event_size``), but it
frames every response chunk in pure Python; the ``httptools`` one (llhttp, C) has no cap: a
client could send one endless header and the parser would buffer it. ``CappedHttpToolsProtocol``
counts the bytes of each request head (up to its blank line) before the parser sees them and
answers ``431 Request Header Fields Too Large`` (then closes) when they pass ``MAX_HEAD_BYTES``:
nothing past the cap reaches the parser's buffers.

A head must also arrive whole within ``head_timeout`` seconds (VLMSERVE_REQUEST_HEAD_TIMEOUT)
of the connection opening, or of the first byte of the next request on a kept-alive
connection; otherwise the connection gets ``408 Request Timeout`` and is closed. Without it, a
client trickling a byte now and then (or saying nothing at all) held its connection for ever:
hundreds of them use up the server's descriptors.

Why not h11: measured on the 2-core CPU with a bare ASGI app streaming 64 SSE events per request
(c=8, server CPU per request): h11 1,150-1,300 us, this protocol 600-800 us.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEAD_TIMEOUT", "MAX_HEAD_BYTES", "CappedHttpToolsProtocol", "with_head_timeout"]

MAX_HEAD_BYTES = 64 * 1024  # request line + headers; h11's cap was the same
HEAD_TIMEOUT = 10.0  # seconds from connect (or a kept-alive request's first byte) to its blank line


class CappedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that refuses a request head larger than ``MAX_HEAD_BYTES``."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout = HEAD_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # a request head is being received
        self._head_bytes = 0  # its bytes so far
        self._tail = b""  # the last bytes of the previous read (a head end split across reads)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_open and not self.transport.is_closing():
            self.logger.info("request head not complete in %.0f s: closed", self.head_timeout)
            self._close_with(b"408 Request Timeout", "request head not complete in time")

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._start_head_timer()  # a kept-alive connection's next request: from its start
            if self._head_bytes + _head_part(self._tail, data) > self.max_head_bytes:
                self.logger.warning("request head over %d bytes refused", self.max_head_bytes)
                self._refuse()
                return
            self._head_bytes += len(data)
            self._tail = data[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes, self._tail = True, 0, b""  # keep-alive: the next one

    def _refuse(self) -> None:
        self._close_with(
            b"431 Request Header Fields Too Large",
            f"request head larger than {self.max_head_bytes} bytes",
        )

    def _close_with(self, status: bytes, msg: str) -> None:
        self._stop_head_timer()
        head = (
            b"HTTP/1.1 " + status + b"\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(msg)).encode("ascii") + b"\r\n"
            b"connection: close\r\n\r\n"
        )
        self.transport.write(head + msg.encode("ascii"))
        self.transport.close()


def _head_part(tail: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to the head: up to its blank line, else all of them."""
    seen = tail + data
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := seen.find(sep)) >= 0]
    return max(0, min(ends) - len(tail)) if ends else len(data)


def with_head_timeout(seconds: float) -> type[CappedHttpToolsProtocol]:
    """The protocol class with its own head deadline (uvicorn makes one instance a connection)."""
    return type("CappedHttpToolsProtocol", (CappedHttpToolsProtocol,), {"head_timeout": seconds})
