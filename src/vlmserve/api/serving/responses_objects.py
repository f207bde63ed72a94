"""Response objects and stream events of OpenAI's Responses API (plain dicts, like chat's).

A response's events are a session's events (``vlmserve.streaming``): ``sequence_number`` is
the session index, so ``starting_after=N`` resumes like ``Last-Event-ID: <id>:N``. The
session's terminal ``[DONE]`` (the last index) is never sent on this wire. ``ResponseLog``
numbers the events it makes and folds stored ones back, which serves three readers: the
producer, the same producer continued after a restart, and ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlmserve.api.protocol.responses import sse_json
from vlmserve.api.protocol.responses_api import ResponsesRequest
from vlmserve.engine.types import Chunk, FinishReason
from vlmserve.errors import ServiceUnavailable, VlmserveError
from vlmserve.streaming import Emit, Event, SessionState

__all__ = [
    "FINAL_EVENTS",
    "ResponseLog",
    "base_response",
    "new_message_id",
    "new_response_id",
    "usage",
]

# The terminal event of each final status. ``response.cancelled`` is vlmserve's: OpenAI's
# event list has none for a cancelled background response.
FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
_FINAL_TYPES = frozenset(FINAL_EVENTS.values())
_PREAMBLE = ("response.created", "response.in_progress", "response.output_item.added",
             "response.content_part.added")  # fmt: skip
_STATUS = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete",
           FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "failed"}  # fmt: skip


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def base_response(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before any output: what ``response.created`` carries."""
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "queued" if body.background else "in_progress", "background": body.background,
        "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "model": model, "output": [], "parallel_tool_calls": False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        "tool_choice": "none", "tools": [], "truncation": "disabled", "usage": None,
        "user": body.user, "completed_at": None,
    }  # fmt: skip


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _error(exc: BaseException) -> dict[str, str]:
    """What a client may read of a failure: its own 4xx or a 503 to retry, else generic."""
    if isinstance(exc, VlmserveError) and (
        exc.status_code < 500 or isinstance(exc, ServiceUnavailable)
    ):
        return {"code": exc.code or "invalid_prompt", "message": exc.message}
    return {"code": "server_error", "message": "generation failed; the server log has details"}


@dataclass(slots=True)
class ResponseLog:
    """One response's event log: makes its numbered events, or folds stored ones back."""

    base: dict[str, Any]
    message_id: str
    next_seq: int = 0
    text: str = ""
    sent: set[str] = field(default_factory=set)
    final: dict[str, Any] | None = None  # the response object of the terminal event
    foreign_error: dict[str, Any] | None = None  # a session error event (server_restart, gap)

    @classmethod
    def restore(cls, request: dict[str, Any], events: list[Event]) -> ResponseLog:
        log = cls(dict(request["response"]), request["message_id"])
        for event in events:
            log._fold(event)
        return log

    def _fold(self, event: Event) -> None:
        self.next_seq = event.index + 1
        if event.terminal:
            return
        data = json.loads(event.data)
        kind = event.event or ""
        self.sent.add(kind)
        if kind == "response.output_text.delta":
            self.text += data["delta"]
        elif kind in _FINAL_TYPES:
            self.final = data["response"]
        elif kind == "error" and isinstance(data.get("error"), dict):
            self.foreign_error = data["error"]

    def _emit(self, kind: str, meta: dict[str, Any] | None = None, **fields: Any) -> Emit:
        data = {"type": kind, "sequence_number": self.next_seq, **fields}
        self.next_seq += 1
        self.sent.add(kind)
        return Emit(sse_json(data), event=kind, meta=meta)

    def _item(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None else [_part(text)]
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def preamble(self) -> list[Emit]:
        """The opening events not sent yet (all of them, unless continued after a restart)."""
        running = {**self.base, "status": "in_progress"}
        make = {
            "response.created": lambda: {"response": self.base},
            "response.in_progress": lambda: {"response": running},
            "response.output_item.added": lambda: {"output_index": 0,
                                                   "item": self._item("in_progress")},
            "response.content_part.added": lambda: {**self._where(), "part": _part("")},
        }  # fmt: skip
        return [self._emit(kind, **make[kind]()) for kind in _PREAMBLE if kind not in self.sent]

    def delta(self, text: str, token_ids: list[int]) -> Emit:
        self.text += text
        return self._emit("response.output_text.delta", {"token_ids": token_ids},
                          **self._where(), delta=text, logprobs=[])  # fmt: skip

    def _close(self, item_status: str) -> list[Emit]:
        if "response.output_item.added" not in self.sent:
            return []
        return [
            self._emit("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
            self._emit("response.content_part.done", **self._where(), part=_part(self.text)),
            self._emit("response.output_item.done", output_index=0,
                       item=self._item(item_status, self.text)),
        ]  # fmt: skip

    def response(self, status: str, usage_: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """The response object now (the terminal event's, once there is one)."""
        if self.final is not None:
            return self.final
        done = status not in ("queued", "in_progress")
        started = "response.output_item.added" in self.sent
        item_status = "completed" if status == "completed" else "incomplete"
        output = [self._item(item_status if done else "in_progress", self.text)] if started else []
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.base, "status": status, "output": output, "usage": usage_,
                "error": error, "incomplete_details": details,
                "completed_at": int(time.time()) if status == "completed" else None}  # fmt: skip

    def _end(self, status: str, usage_: dict[str, Any] | None = None,
             error: dict[str, str] | None = None) -> list[Emit]:  # fmt: skip
        item_status = "completed" if status == "completed" else "incomplete"
        emits = self._close(item_status)
        final = self.response(status, usage_, error)
        emits.append(self._emit(FINAL_EVENTS[status], response=final))
        self.final = final
        return emits

    def finish(self, chunk: Chunk) -> list[Emit]:
        """The closing events after the engine's last chunk."""
        assert chunk.finish_reason is not None
        status = _STATUS[chunk.finish_reason]
        return self._end(status, usage(chunk.prompt_tokens, chunk.completion_tokens))

    def on_cancel(self) -> list[Emit]:
        return self._end("cancelled")

    def on_error(self, exc: BaseException) -> list[Emit]:
        return self._end("failed", error=_error(exc))

    def snapshot(self, state: SessionState) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the response as its stored events and state say."""
        if self.final is not None:
            return self.final
        if state is SessionState.RUNNING:
            return self.response("in_progress" if "response.in_progress" in self.sent
                                 else self.base["status"])  # fmt: skip
        if state is SessionState.CANCELLED:
            return self.response("cancelled")
        error = self.foreign_error or {"message": "the response ended without a result"}
        return self.response("failed", error={"code": str(error.get("code") or "server_error"),
                                              "message": str(error.get("message"))})  # fmt: skip
