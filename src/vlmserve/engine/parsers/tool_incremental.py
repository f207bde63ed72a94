"""``hermes`` tool calls streamed as they are generated (vLLM's behaviour), not per block.

``HermesToolParser.stream(incremental=True)`` returns this stream. A call goes out as soon
as its block starts with ``{"name": "<name>", "arguments": {``: the first delta carries
``index``, ``id``, ``type`` and ``function.name``; every later feed carries the arguments
text generated since, as ``function.arguments`` fragments, until the arguments object
closes (what follows it up to ``</tool_call>``, normally ``}\\n``, is dropped).

The price of not waiting for the block to end: a call already sent cannot be taken back.
If its arguments then turn out malformed, or the block ends (``</tool_call>`` or end of
output) before they close, the call keeps the arguments sent so far. Blocks in another
shape (``"arguments"`` first, ``"parameters"``, arguments as a JSON string) fall back to
the per-block handling of ``ToolCallStream``: a call when the block closes, else content.
For well-formed calls both streams and ``parse`` agree (arguments here are the model's
own text, there re-serialised by ``json.dumps``: equal as JSON).
"""

from __future__ import annotations

import enum
import json
import re

from vlmserve.engine.parsers.text import partial_suffix
from vlmserve.engine.parsers.tool_calls import (
    HermesToolParser,
    ToolCall,
    ToolCallStream,
    ToolDelta,
    new_call_id,
)

__all__ = ["IncrementalToolCallStream"]

# The committed prefix of a block: the name, then the arguments object's opening brace.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


class _State(enum.Enum):
    OUTSIDE = "outside"  # content
    BODY = "body"  # in a block, nothing sent yet
    ARGS = "args"  # call sent, streaming its arguments
    TAIL = "tail"  # arguments closed, waiting for the end tag


class IncrementalToolCallStream(ToolCallStream):
    __slots__ = ("_depth", "_escape", "_in_string", "_state")

    def __init__(self, parser: HermesToolParser):
        super().__init__(parser)
        self._state = _State.OUTSIDE
        self._depth = 0  # JSON nesting inside the arguments
        self._in_string = False
        self._escape = False

    def feed(self, delta: str) -> ToolDelta:
        self._pending += delta
        out = ToolDelta()
        while self._pending:
            before = (self._state, self._pending)
            if self._state is _State.OUTSIDE:
                self._outside(out)
            elif self._state is _State.BODY:
                self._body(out)
            elif self._state is _State.ARGS:
                self._args(out)
            else:
                self._tail()
            if (self._state, self._pending) == before:
                break  # waiting for more text
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._state is _State.BODY:
            self._close_block(self._pending, "", out)
        elif self._state is _State.OUTSIDE:
            out.content += self._pending
        elif self._state is _State.ARGS and self._pending:
            self._send_arguments(self._pending, out)  # a possible end-tag prefix: arguments
        self._pending, self._state = "", _State.OUTSIDE
        return out

    def _outside(self, out: ToolDelta) -> None:
        before, tag, rest = self._pending.partition(self._parser.start)
        if tag:
            out.content += before
            self._pending, self._state = rest, _State.BODY
            return
        cut = len(self._pending) - partial_suffix(self._pending, self._parser.start)
        out.content += self._pending[:cut]
        self._pending = self._pending[cut:]

    def _body(self, out: ToolDelta) -> None:
        body, closed, rest = self._pending.partition(self._parser.end)
        match = _HEADER.match(body)
        if match is not None:
            try:
                name = json.loads(match.group(1))
            except ValueError:
                name = ""
            if name:
                self._open_call(name, out)
                self._pending = self._pending[match.end() :]
                return
        if closed:  # never committed: the whole block decides, as ToolCallStream does
            self._pending = rest
            self._close_block(body, closed, out)
            self._state = _State.OUTSIDE

    def _open_call(self, name: str, out: ToolDelta) -> None:
        call = ToolCall(new_call_id(), name, "")
        self.calls.append(call)
        self._state, self._depth, self._in_string, self._escape = _State.ARGS, 0, False, False
        out.tool_calls.append(
            {
                "index": len(self.calls) - 1,
                "id": call.id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _args(self, out: ToolDelta) -> None:
        """Send the arguments text up to their closing brace, an end tag, or a tag prefix."""
        text, end = self._pending, self._parser.end
        i = 0
        while i < len(text):
            if text[i] == "<":
                if text.startswith(end, i):  # cut short: the call keeps what was sent
                    self._send_arguments(text[:i], out)
                    self._pending, self._state = text[i + len(end) :], _State.OUTSIDE
                    return
                if end.startswith(text[i:]):
                    break  # maybe the end tag: wait
            i += 1
            if self._scan(text[i - 1]):
                self._state = _State.TAIL
                break
        self._send_arguments(text[:i], out)
        self._pending = text[i:]

    def _scan(self, char: str) -> bool:
        """Advance the JSON scanner by one character; True when the arguments close."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth <= 0
        return False

    def _send_arguments(self, fragment: str, out: ToolDelta) -> None:
        if not fragment:
            return
        call = self.calls[-1]
        call.arguments += fragment
        index = len(self.calls) - 1
        out.tool_calls.append({"index": index, "function": {"arguments": fragment}})

    def _tail(self) -> None:
        _, closed, rest = self._pending.partition(self._parser.end)
        if closed:
            self._pending, self._state = rest, _State.OUTSIDE
        else:  # drop all but a possible end-tag prefix
            keep = partial_suffix(self._pending, self._parser.end)
            self._pending = self._pending[len(self._pending) - keep :]
