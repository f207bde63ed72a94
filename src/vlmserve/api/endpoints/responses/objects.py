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
from dataclasses import dataclass, field, replace
from typing import Any

from vlmserve.api.endpoints.chat.objects import sse_json
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
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
_PREAMBLE = ("response.created", "response.in_progress")
_STATUS = {
    FinishReason.STOP: "completed",
    FinishReason.LENGTH: "incomplete",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "failed",
}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def base_response(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before any output: what ``response.created`` carries."""
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued" if body.background else "in_progress",
        "background": body.background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": False,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": "none",
        "tools": [],
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "completed_at": None,
    }


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
    """One response's event log: makes its numbered events, or folds stored ones back.

    Output items open as their text arrives: a thinking model's ``reasoning`` item (output 0)
    with ``response.reasoning_text.delta`` events, then the ``message`` (output 0, or 1 after
    a reasoning item). ``sent`` records event kinds, and ``<kind>:<item type>`` for items."""

    base: dict[str, Any]
    message_id: str
    next_seq: int = 0
    text: str = ""
    reasoning: str = ""
    sent: set[str] = field(default_factory=set)
    final: dict[str, Any] | None = None  # the response object of the terminal event
    closing: dict[str, Any] | None = None  # how it was ending (a closing event's meta)
    foreign_error: dict[str, Any] | None = None  # a session error event (server_restart, gap)
    cached_tokens: int | None = None  # the request's prefix-cache hits (in its first event's meta)
    metrics: dict[str, Any] | None = None  # the request's timings, once it ended (when asked)

    @classmethod
    def restore(cls, request: dict[str, Any], events: list[Event]) -> ResponseLog:
        log = cls(dict(request["response"]), request["message_id"])
        for event in events:
            log._fold(event)
        return log

    @property
    def reasoning_id(self) -> str:
        return "rs_" + self.message_id.removeprefix("msg_")

    def _mark(self, kind: str, data: dict[str, Any]) -> None:
        self.sent.add(kind)
        if isinstance(data.get("item"), dict):
            self.sent.add(f"{kind}:{data['item'].get('type')}")

    def _fold(self, event: Event) -> None:
        self.next_seq = event.index + 1
        if event.terminal:
            return
        if event.meta and "closing" in event.meta:
            self.closing = event.meta["closing"]
        if event.meta and event.meta.get("cached_tokens") is not None:
            self.cached_tokens = event.meta["cached_tokens"]
        data = json.loads(event.data)
        kind = event.event or ""
        self._mark(kind, data)
        if kind == "response.output_text.delta":
            self.text += data["delta"]
        elif kind == "response.reasoning_text.delta":
            self.reasoning += data["delta"]
        elif kind in _FINAL_TYPES:
            self.final = data["response"]
        elif kind == "error" and isinstance(data.get("error"), dict):
            self.foreign_error = data["error"]

    def _emit(self, kind: str, meta: dict[str, Any] | None = None, **fields: Any) -> Emit:
        data = {"type": kind, "sequence_number": self.next_seq, **fields}
        self.next_seq += 1
        self._mark(kind, data)
        return Emit(sse_json(data), event=kind, meta=meta)

    def _opened(self, item: str) -> bool:
        return f"response.output_item.added:{item}" in self.sent

    def _closed(self, item: str) -> bool:
        return f"response.output_item.done:{item}" in self.sent

    def _message_index(self) -> int:
        return 1 if self._opened("reasoning") else 0

    def _item(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None else [_part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _reasoning_item(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": content,
        }

    def _where(self) -> dict[str, Any]:
        return {
            "item_id": self.message_id,
            "output_index": self._message_index(),
            "content_index": 0,
        }

    def _reasoning_where(self) -> dict[str, Any]:
        return {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}

    def preamble(self) -> list[Emit]:
        """The opening events not sent yet (all of them, unless continued after a restart)."""
        running = {**self.base, "status": "in_progress"}
        make = {
            "response.created": lambda: {"response": self.base},
            "response.in_progress": lambda: {"response": running},
        }
        return [self._emit(kind, **make[kind]()) for kind in _PREAMBLE if kind not in self.sent]

    def _close_reasoning(self) -> list[Emit]:
        if not self._opened("reasoning") or self._closed("reasoning"):
            return []
        where = self._reasoning_where()
        emits = (
            []
            if "response.reasoning_text.done" in self.sent
            else [self._emit("response.reasoning_text.done", **where, text=self.reasoning)]
        )
        item = self._reasoning_item("completed", self.reasoning)
        return [*emits, self._emit("response.output_item.done", output_index=0, item=item)]

    def _open_message(self) -> list[Emit]:
        if self._opened("message"):
            return []
        emits = self._close_reasoning()
        emits.append(
            self._emit(
                "response.output_item.added",
                output_index=self._message_index(),
                item=self._item("in_progress"),
            )
        )
        emits.append(self._emit("response.content_part.added", **self._where(), part=_part("")))
        return emits

    def think(self, text: str, token_ids: list[int]) -> list[Emit]:
        """Reasoning text: the reasoning item's delta (the item opens with the first)."""
        emits = []
        if not self._opened("reasoning"):
            emits.append(
                self._emit(
                    "response.output_item.added",
                    output_index=0,
                    item=self._reasoning_item("in_progress"),
                )
            )
        self.reasoning += text
        emits.append(
            self._emit(
                "response.reasoning_text.delta",
                {"token_ids": token_ids},
                **self._reasoning_where(),
                delta=text,
            )
        )
        return emits

    def delta(self, text: str, token_ids: list[int]) -> list[Emit]:
        """Answer text: the message's delta (the message opens with the first)."""
        emits = self._open_message()
        self.text += text
        emits.append(
            self._emit(
                "response.output_text.delta",
                {"token_ids": token_ids},
                **self._where(),
                delta=text,
                logprobs=[],
            )
        )
        return emits

    def answered(self, text: str, reasoning: str | None) -> None:
        """The items of a whole answer (not streamed): its reasoning, if any, and a message
        unless the answer was cut off while thinking."""
        if reasoning:
            self.reasoning = reasoning
            self.sent.add("response.output_item.added:reasoning")
        if text or not reasoning:
            self.text = text
            self.sent.add("response.output_item.added:message")

    def _close(self, item_status: str) -> list[Emit]:
        if "response.in_progress" not in self.sent:
            return []  # ended before it started (cancelled while queued): no items
        if self._opened("reasoning") and not self._opened("message"):
            return self._close_reasoning()  # cut off while thinking: no message
        emits = self._open_message()  # an empty answer is still a message
        closing = {  # each only once (a stream continued after a restart may have sent some)
            "response.output_text.done": lambda: self._emit(
                "response.output_text.done", **self._where(), text=self.text, logprobs=[]
            ),
            "response.content_part.done": lambda: self._emit(
                "response.content_part.done", **self._where(), part=_part(self.text)
            ),
            "response.output_item.done:message": lambda: self._emit(
                "response.output_item.done",
                output_index=self._message_index(),
                item=self._item(item_status, self.text),
            ),
        }
        return [*emits, *(make() for kind, make in closing.items() if kind not in self.sent)]

    def response(
        self, status: str, usage_: dict[str, Any] | None = None, error: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The response object now (the terminal event's, once there is one)."""
        if self.final is not None:
            return self.final
        done = status not in ("queued", "in_progress")
        item_status = "completed" if status == "completed" else "incomplete"
        output = []
        if self._opened("reasoning"):
            closed = done or self._closed("reasoning")
            output.append(
                self._reasoning_item("completed" if closed else "in_progress", self.reasoning)
            )
        if self._opened("message"):
            output.append(self._item(item_status if done else "in_progress", self.text))
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        out = {
            **self.base,
            "status": status,
            "output": output,
            "usage": usage_,
            "error": error,
            "incomplete_details": details,
            "completed_at": int(time.time()) if status == "completed" else None,
        }
        return out if self.metrics is None else {**out, "metrics": self.metrics}

    def _end(
        self, status: str, usage_: dict[str, Any] | None = None, error: dict[str, str] | None = None
    ) -> list[Emit]:
        if self.final is not None:
            return []
        item_status = "completed" if status == "completed" else "incomplete"
        emits = self._close(item_status)
        final = self.response(status, usage_, error)
        emits.append(self._emit(FINAL_EVENTS[status], response=final))
        self.final = final
        closing = {"status": status, "usage": usage_, "error": error}
        # how to end it again if a kill cuts it short here (``end_again``)
        return [replace(e, meta={**(e.meta or {}), "closing": closing}) for e in emits]

    def end_again(self) -> list[Emit]:
        """The closing events a stream cut short while ending had not stored yet."""
        if self.closing is None:
            return []
        return self._end(
            self.closing["status"], self.closing.get("usage"), self.closing.get("error")
        )

    def finish(self, chunk: Chunk) -> list[Emit]:
        """The closing events after the engine's last chunk."""
        ending = self.ending(chunk)
        return self._end(ending["status"], ending["usage"])

    @staticmethod
    def ending(chunk: Chunk) -> dict[str, Any]:
        """How the engine's last chunk ends the response (the closing events' meta, also
        kept with that chunk's own text events: ``end_again`` reads it back)."""
        assert chunk.finish_reason is not None
        return {
            "status": _STATUS[chunk.finish_reason],
            "error": None,
            "usage": usage(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens),
        }

    def on_cancel(self) -> list[Emit]:
        return self._end("cancelled")

    def on_error(self, exc: BaseException) -> list[Emit]:
        return self._end("failed", error=_error(exc))

    def snapshot(self, state: SessionState) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the response as its stored events and state say."""
        if self.final is not None:
            return self.final
        if state is SessionState.RUNNING:
            return self.response(
                "in_progress" if "response.in_progress" in self.sent else self.base["status"]
            )
        if state is SessionState.CANCELLED:
            return self.response("cancelled")
        error = self.foreign_error or {"message": "the response ended without a result"}
        return self.response(
            "failed",
            error={
                "code": str(error.get("code") or "server_error"),
                "message": str(error.get("message")),
            },
        )
