"""Map every error to OpenAI's error JSON in one place: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve.errors import Overloaded, ServiceUnavailable, VlmserveError

__all__ = [
    "ERROR_RESPONSES",
    "ErrorResponse",
    "error_body",
    "error_response",
    "install_error_handlers",
    "internal_error_body",
]

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every 4xx/5xx this server sends."""

    error: ErrorDetail


_DOCUMENTED = {
    400: "invalid request (bad input, undecodable or blocked media, unsupported feature)",
    401: "missing or wrong API key",
    403: "forbidden",
    404: "unknown model, session or route",
    408: "media preprocessing took longer than the limit (VLMSERVE_MEDIA_TIMEOUT)",
    413: "over a size limit (body, media bytes, pixels, frames)",
    422: "the model's answer does not fit the task's schema (task routes)",
    429: "queue full; retry after Retry-After seconds",
    503: "model not ready or no healthy replica; retry after Retry-After seconds",
}
# Declared on every operation so OpenAPI clients (and contract fuzzers) know the error shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in _DOCUMENTED.items()
}


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: VlmserveError) -> JSONResponse:
    headers = {}
    if isinstance(exc, ServiceUnavailable | Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    body = error_body(exc.message, exc.error_type, exc.code, exc.param)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


# Location parts pydantic adds for union members and validator wrappers
# (``function-after[valid_unicode(), str]``, ``str``, ``list[...]``): not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_field(part: str) -> bool:
    return not any(c in part for c in "[]()-,") and part.lower() not in _TYPE_TAGS


def _location(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``."""
    out, last = "", None
    for p in (str(p) for p in loc if p != "body"):
        if p.isdigit():
            out += f"[{p}]"
        elif _is_field(p) and p != last:  # a tagged union repeats its tag: `image_url.image_url`
            out += f".{p}" if out else p
        last = p
    return out


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # The deepest location is the most specific: for a union (``content`` as text or parts),
    # pydantic reports every branch, and the branch that got furthest is the one meant.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default=None) or {
        "loc": (),
        "msg": "invalid request",
    }
    if first.get("type") == "json_invalid":  # the body is not JSON: say why, no position noise
        reason = (first.get("ctx") or {}).get("error", "")
        message = f"the body is not valid JSON: {reason}" if reason else "body is not valid JSON"
        return JSONResponse(
            error_body(message, "invalid_request_error", "invalid_json", None), status_code=400
        )
    param = _location(tuple(first.get("loc", ())))
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{param}: {reason}" if param else reason
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return JSONResponse(
        error_body(message, "invalid_request_error", "invalid_value", param or None),
        status_code=400,  # OpenAI answers a malformed request with 400, not 422
    )


def _http_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(str(exc.detail), type_, None, None),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def internal_error_body(request_id: str) -> dict:
    """The body of every 500: the request id to find the details in the log, nothing more."""
    message = f"internal server error (request id {request_id}); the server log has the details"
    return error_body(message, "internal_error", "internal_error")


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    rid = getattr(request.state, "request_id", "-")
    log.error("unhandled error in request %s", rid, exc_info=exc)
    return JSONResponse(internal_error_body(rid), status_code=500)


def _on_loop(handler: Callable[[Request, Any], JSONResponse]) -> Callable[..., Any]:
    """The handler as a coroutine: Starlette runs a plain function in its thread pool, a hop
    of ~0.3 ms per error response on a small machine for what is a dict and a JSON dump."""

    async def handle(request: Request, exc: Any) -> JSONResponse:
        return handler(request, exc)

    return handle


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(VlmserveError, _on_loop(lambda r, e: error_response(e)))
    app.add_exception_handler(RequestValidationError, _on_loop(_validation_response))
    app.add_exception_handler(StarletteHTTPException, _on_loop(_http_response))
    app.add_exception_handler(Exception, _on_loop(_unexpected))
