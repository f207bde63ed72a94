"""Pure-ASGI middleware: request ids, the body-size limit enforced before parsing, and the last
line of defence that turns an unhandled error into a 500 in the OpenAI shape *inside* the CORS
layer (Starlette's own 500 is sent from outside every middleware, so it carries no CORS headers
and a browser reports a CORS failure instead of the error)."""

from __future__ import annotations

import json
import logging
import os
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmserve.api.common.timings import arrived_now
from vlmserve.api.errors import error_body, internal_error_body

__all__ = ["BodyLimitMiddleware", "ErrorShieldMiddleware", "RequestIdMiddleware"]

log = logging.getLogger("vlmserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _error_bytes(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", code)).encode()


class ErrorShieldMiddleware:
    """An exception that escapes the app becomes a 500 in the OpenAI shape, sent through the
    middlewares outside this one (CORS, request id, metrics). Once a response has started (a
    stream), the error is re-raised: nothing can be said on that response any more."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            rid = scope.get("state", {}).get("request_id", "-")
            log.error("unhandled error in request %s", rid, exc_info=exc)
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            body = json.dumps(internal_error_body(rid)).encode()
            await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Takes a sane ``X-Request-ID`` from the client or makes one; echoes it and logs it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived_now()  # per-request timings start here (common/timings.py)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SAFE_ID.match(given) else os.urandom(16).hex()  # uuid4's cost, less
        scope.setdefault("state", {})["request_id"] = rid
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", rid.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("%s %s %s -> %s", rid, scope["method"], scope["path"], status)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: by Content-Length before reading, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._reject(send)
            return
        seen, too_large, started = 0, False, False

        async def counting_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns an error raised while it reads the body into its own 400; once the
            # body is known to be too large, that answer is dropped and the 413 sent instead.
            nonlocal started
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = _error_bytes(
            f"request body is larger than {self.max_bytes} bytes (VLMSERVE_MAX_BODY_BYTES); "
            "send smaller or fewer media items, or URLs instead of inline base64",
            "payload_too_large",
        )
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
