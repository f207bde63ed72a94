"""Pure-ASGI middleware: request ids, and the body-size limit enforced before parsing."""

from __future__ import annotations

import json
import logging
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware", "RequestIdMiddleware"]

log = logging.getLogger("vlmserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _error_bytes(message: str, code: str) -> bytes:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return json.dumps(body).encode()


class RequestIdMiddleware:
    """Takes a sane ``X-Request-ID`` from the client or makes one; echoes it and logs it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
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
