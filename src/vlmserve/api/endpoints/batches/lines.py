"""One batch line: read from the input file, run through the endpoint's own service, written in
OpenAI's output line format.

    input   {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output  {"id": "batch_req_...", "custom_id": "a", "error": null,
             "response": {"status_code": 200, "request_id": "...", "body": {...}}}
    error   the same with the 4xx (or 500) status and its error body in ``response``, and
            ``error`` = {"code", "message"}

The file is checked before any line runs (``batches_input``); a line whose *body* the
endpoint refuses is an error line and the batch goes on.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from vlmserve.api.endpoints.batches.input import LineRequest
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.chat.service import ChatService
from vlmserve.api.endpoints.embeddings.protocol import EmbeddingsRequest
from vlmserve.api.endpoints.files.store import LineResult
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.api.endpoints.responses.service import ResponsesService
from vlmserve.api.endpoints.worker.service import WorkerService
from vlmserve.api.errors import error_body
from vlmserve.engine.types import BATCH_PRIORITY
from vlmserve.errors import InvalidRequest, VlmserveError

__all__ = ["ENDPOINTS", "Endpoints", "error_result", "expired_result", "ok_result"]

ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/embeddings")


def _request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def ok_result(line: LineRequest, request_id: str, body: dict[str, Any]) -> LineResult:
    response = {"status_code": 200, "request_id": request_id, "body": body}
    result = {"id": _request_id(), "custom_id": line.custom_id, "response": response, "error": None}
    return LineResult(line.line, True, result)


def error_result(line: LineRequest, request_id: str, exc: VlmserveError) -> LineResult:
    code = exc.code or exc.error_type
    body = error_body(exc.message, exc.error_type, code, exc.param)
    response = {"status_code": exc.status_code, "request_id": request_id, "body": body}
    result = {
        "id": _request_id(),
        "custom_id": line.custom_id,
        "response": response,
        "error": {"code": code, "message": exc.message},
    }
    return LineResult(line.line, False, result)


def expired_result(line: LineRequest) -> LineResult:
    """A line the completion window ended before it ran (OpenAI's ``batch_expired`` entry)."""
    error = {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    }
    result = {"id": _request_id(), "custom_id": line.custom_id, "response": None, "error": error}
    return LineResult(line.line, False, result)


def _invalid(exc: ValidationError) -> InvalidRequest:
    """A body the endpoint's wire model refuses: the first problem, as the routes' 400 says."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
    param = ".".join(str(p) for p in first.get("loc", ()))
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    return InvalidRequest(
        f"{param}: {reason}{more}" if param else reason + more,
        param=param or None,
        code="invalid_value",
    )


def _validate(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("the line's body must be a JSON object", param="body")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    if getattr(parsed, "stream", False) or getattr(parsed, "background", False):
        raise InvalidRequest("a batch line cannot stream or run in the background", param="stream")
    return parsed


class Endpoints:
    """Runs a line's body through the service of its endpoint (never a second implementation)."""

    def __init__(self, chat: ChatService, responses: ResponsesService, worker: WorkerService):
        self._run: dict[str, Callable[[Any, str, str], Awaitable[dict[str, Any]]]] = {
            "/v1/chat/completions": self._chat,
            "/v1/responses": self._responses,
            "/v1/embeddings": self._embeddings,
        }
        self.chat, self.responses, self.worker = chat, responses, worker

    async def run(self, endpoint: str, body: Any, request_id: str, owner: str) -> dict[str, Any]:
        """The line's answer, as the batch's owner (their files, their stored responses)."""
        return await self._run[endpoint](body, request_id, owner)

    async def _chat(self, body: Any, request_id: str, owner: str) -> dict[str, Any]:
        parsed = _validate(ChatCompletionRequest, body)
        # as the owner: the prefix cache is salted by its key (no place of its per-key cap)
        return await self.chat.complete(parsed, request_id, priority=BATCH_PRIORITY, owner=owner)

    async def _responses(self, body: Any, request_id: str, owner: str) -> dict[str, Any]:
        parsed = _validate(ResponsesRequest, body)
        return await self.responses.complete_unstored(
            parsed, request_id, owner, priority=BATCH_PRIORITY
        )

    async def _embeddings(self, body: Any, request_id: str, owner: str) -> dict[str, Any]:
        return await self.worker.embeddings(_validate(EmbeddingsRequest, body))
