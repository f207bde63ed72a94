"""Tool-call parsers: find the function calls in a model's output text.

``hermes`` (vLLM's name) reads the format of Hermes 2 Pro, Qwen2.5(-VL) and Qwen3(-VL)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is a JSON object with a string ``name`` (and ``arguments`` -- or
``parameters`` -- an object or a JSON string, default ``{}``) is a call; any other block,
malformed JSON included, stays in the content verbatim. Parsing never raises. A block left
open at the end of the output (stopped by EOS or a stop string) is a call if its body is one.

    parser = TOOL_PARSERS["hermes"]
    content, calls = parser.parse(text)              # one shot
    stream = parser.stream()                         # per block, one per choice
    for delta in deltas: d = stream.feed(delta)      # d.content, d.tool_calls
    d = stream.finish()

Streamed calls use the OpenAI delta shape: a call's first delta carries ``index``, ``id``,
``type: "function"`` and ``function.name`` (with ``arguments: ""``); its next deltas carry
``function.arguments`` fragments. By default a block is emitted when it closes, so a
malformed one can still go out as content: the streamed totals always equal ``parse`` of the
whole text (ids aside). ``stream(incremental=True)`` sends the arguments as they are
generated instead, and cannot take back a call whose JSON breaks later
(``tool_incremental.py``).

Content outside the blocks passes through; only a possible ``<tool_call>`` prefix at the end
of a delta is held back. One ``ToolDelta`` holds all the content of its feed before its tool
calls (send content first). Whitespace between blocks is content: callers usually send
``content.strip() or None`` next to tool calls.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from vlmserve.engine.parsers.text import partial_suffix

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "ToolCall",
    "ToolCallStream",
    "ToolDelta",
    "new_call_id",
]

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """``call_`` and 24 random letters/digits, the shape OpenAI's ids have."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI's function.arguments

    def to_openai(self) -> dict[str, Any]:
        """The ``message.tool_calls[i]`` object."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolDelta:
    """What one ``feed`` releases: content text and OpenAI ``delta.tool_calls`` items."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def call_from_json(body: str, call_id: str | None = None) -> ToolCall | None:
    """A call from one block's JSON body, or None if it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # malformed, or nested past Python's stack
        return None
    return call_from_object(data, call_id)


def call_from_object(data: Any, call_id: str | None = None) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments": ...}`` object, or None."""
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(call_id or new_call_id(), name, text)


@dataclass(frozen=True, slots=True)
class HermesToolParser:
    name: str = "hermes"
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output -> (content outside the calls, the calls in order)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            before, tag, rest = text.partition(self.start)
            content.append(before)
            if not tag:
                break
            body, closed, text = rest.partition(self.end)
            call = call_from_json(body)
            if call is None:
                content.append(self.start + body + closed)
            else:
                calls.append(call)
            if not closed:
                break
        return "".join(content), calls

    def stream(self, *, incremental: bool = False) -> ToolCallStream:
        """A fresh stream for one output. ``incremental``: send each call and its arguments
        as they are generated (see ``tool_incremental``) instead of when its block closes."""
        if incremental:
            from vlmserve.engine.parsers.tool_incremental import IncrementalToolCallStream

            return IncrementalToolCallStream(self)
        return ToolCallStream(self)


class ToolCallStream:
    """Incremental ``hermes`` parsing of one output."""

    __slots__ = ("_in_block", "_parser", "_pending", "calls")

    def __init__(self, parser: HermesToolParser):
        self._parser = parser
        self._pending = ""
        self._in_block = False
        self.calls: list[ToolCall] = []  # every call released so far, in index order

    def feed(self, delta: str) -> ToolDelta:
        self._pending += delta
        out = ToolDelta()
        while True:
            if self._in_block:
                body, closed, rest = self._pending.partition(self._parser.end)
                if not closed:
                    break  # wait for the end tag (or finish)
                self._pending = rest
                self._close_block(body, closed, out)
            else:
                before, tag, rest = self._pending.partition(self._parser.start)
                if tag:
                    out.content += before
                    self._pending, self._in_block = rest, True
                    continue
                keep = partial_suffix(self._pending, self._parser.start)
                cut = len(self._pending) - keep
                out.content += self._pending[:cut]
                self._pending = self._pending[cut:]
                break
        return out

    def finish(self) -> ToolDelta:
        """End of output: an open block is a call if its body is one, else content."""
        out = ToolDelta()
        if self._in_block:
            self._close_block(self._pending, "", out)
        else:
            out.content += self._pending
        self._pending = ""
        return out

    def _close_block(self, body: str, closed: str, out: ToolDelta) -> None:
        self._in_block = False
        call = call_from_json(body)
        if call is None:
            out.content += self._parser.start + body + closed
            return
        index = len(self.calls)
        self.calls.append(call)
        out.tool_calls.append(
            {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
        )
        out.tool_calls.append({"index": index, "function": {"arguments": call.arguments}})


TOOL_PARSERS: dict[str, HermesToolParser] = {"hermes": HermesToolParser()}
