"""Admission of request bodies against the media memory budget, before a byte is read.

A POST body of ``min_bytes`` or more is admitted by its ``Content-Length`` (``MediaBudget``):
it waits for room in a bounded queue, or is answered 429 (``Retry-After``) or 413 without
being parsed. A chunked body is charged as it streams. Smaller bodies (text chats) never
wait here; every request gets a lease so that media it fetches by URL are still counted.
The lease ends when the request's media are handed to the engine (``budget.hand_over``) or,
at the latest, when the request ends.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmserve.api.errors import error_body
from vlmserve.errors import Overloaded, VlmserveError
from vlmserve.media.workers.budget import BODY_FACTOR, Lease, MediaBudget

__all__ = ["MediaAdmissionMiddleware"]

# uploads are streamed to disk and batch inputs are read from files: neither holds media
_EXEMPT = ("/v1/files", "/v1/batches", "/admin")


class MediaAdmissionMiddleware:
    def __init__(self, app: ASGIApp, budget: MediaBudget, min_bytes: int = 64 * 1024):
        self.app = app
        self.budget = budget
        self.min_bytes = min_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(_EXEMPT):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        try:
            lease = await self._admit(length)
        except VlmserveError as exc:
            await _drain(receive)  # the client reads the answer instead of a reset connection
            await _refuse(send, exc)
            return
        token = self.budget.use(lease)
        if length is None:
            receive = _charging(receive, lease)
        try:
            await self.app(scope, receive, send)
        finally:
            lease.release()
            token.var.reset(token)

    async def _admit(self, length: bytes | None) -> Lease:
        size = int(length) if length is not None and length.isdigit() else 0
        if size < self.min_bytes:
            return Lease(self.budget, 0)
        return await self.budget.admit(BODY_FACTOR * size)


def _charging(receive: Receive, lease: Lease) -> Receive:
    """A chunked body's bytes charged to its lease as they arrive."""

    async def counted() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            lease.grow(BODY_FACTOR * len(message.get("body", b"")))
        return message

    return counted


async def _drain(receive: Receive) -> None:
    """Read and drop the body (the body limit outside bounds it)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _refuse(send: Send, exc: VlmserveError) -> None:
    body = json.dumps(error_body(exc.message, exc.error_type, exc.code, exc.param)).encode()
    headers = [(b"content-type", b"application/json")]
    if isinstance(exc, Overloaded):
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
