"""Generated text -> the answer's parts: reasoning, content and tool calls, chunk by chunk.

An in-process backend wraps its chunks with ``parse_outputs``: a thinking model's reasoning
(``<think>...</think>``, ``parsers/reasoning.py``) goes to ``Chunk.reasoning``, tool calls
(``<tool_call>{...}</tool_call>``, ``parsers/tool_calls.py``) to ``Chunk.tool_calls`` in
OpenAI's streaming delta shape, and the rest stays ``Chunk.text``. A call is sent once its
block is complete (so a malformed one stays text and streamed totals equal the one-shot
parse). With ``tool_choice`` required or named the grammar makes the whole answer bare JSON
(``{"name", "arguments"}`` or a list of them), read back at the end; cut by ``max_tokens``
before it closes, that JSON is the content (``finish_reason: "length"``). An answer with
calls ends with ``finish_reason: "tool_calls"``.

Proxied backends get these parts from their upstream (``upstream_wire``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from vlmserve.engine.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReasoningStream,
    ToolCall,
    ToolCallStream,
    calls_from_enforced,
)
from vlmserve.engine.types import Chunk, FinishReason, OutputOptions
from vlmserve.errors import ConfigError

__all__ = ["OutputParsers", "check_parser_names", "parse_outputs"]


def check_parser_names(reasoning: str | None, tools: str | None) -> None:
    """Fail at start-up on a parser name that does not exist, listing the ones that do."""
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ConfigError(f"reasoning parser {reasoning!r} does not exist; use one of {known}")
    if tools is not None and tools not in TOOL_PARSERS:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ConfigError(f"tool-call parser {tools!r} does not exist; use one of {known}")


@dataclass(slots=True)
class OutputParsers:
    """The parsers one request's answer goes through (None: that part is not parsed)."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None
    options: OutputOptions
    called: int = 0  # tool calls sent so far
    # the tag that ends a reasoning the prompt opened (None: the answer starts at once);
    # a response-format grammar applies only after it
    reasoning_end: str | None = None

    @classmethod
    def build(
        cls, options: OutputOptions, reasoning: str | None, tools: str | None, prompt: str
    ) -> OutputParsers:
        thinking = REASONING_PARSERS[reasoning].stream(prompt=prompt) if reasoning else None
        calls = None
        if options.parse_tools and not options.enforced_tool_calls:
            calls = TOOL_PARSERS[tools or "hermes"].stream()
        opened = thinking.end_tag if thinking is not None and thinking.reasoning_at_start else None
        return cls(thinking, calls, options, reasoning_end=opened)

    @property
    def active(self) -> bool:
        parsing = self.reasoning is not None or self.tools is not None
        return parsing or self.options.enforced_tool_calls

    def skip(self, text: str) -> None:
        """Text an earlier run already sent (a resumed stream): advance the state only."""
        self.feed(text)

    def think(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the next piece of text."""
        thought, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning is not None:
            more_thought, more = self.reasoning.finish()
            thought, content = thought + more_thought, content + more
        return thought, content

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]] | None]:
        """(reasoning, content, tool_call deltas) of the next piece of text."""
        thought, content = self.think(text, final)
        if self.tools is None:
            return thought, content, None
        delta = self.tools.feed(content)
        if final:
            tail = self.tools.finish()
            delta.content += tail.content
            delta.tool_calls += tail.tool_calls
        calls = self._numbered(delta.tool_calls) if delta.tool_calls else None
        return thought, delta.content if not calls else delta.content.strip(), calls

    def _numbered(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.options.parallel_tool_calls:
            calls = [c for c in calls if c.get("index", 0) == 0]
        self.called += sum(1 for c in calls if "id" in c)
        return calls

    def enforced(self, text: str) -> list[dict[str, Any]]:
        """The calls of a grammar-enforced answer (bare JSON), as whole-call deltas."""
        calls = calls_from_enforced(text)
        if not self.options.parallel_tool_calls:
            calls = calls[:1]
        self.called = len(calls)
        return [_delta(i, call) for i, call in enumerate(calls)]


def _delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, **call.to_openai()}


async def parse_outputs(
    chunks: AsyncIterator[Chunk], parsers: OutputParsers
) -> AsyncIterator[Chunk]:
    """Split each chunk's text into reasoning / content / tool calls (see the module doc)."""
    try:
        async for chunk in _parsed(chunks, parsers):
            yield chunk
    finally:  # closing this generator cancels the request: close the engine's now
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _parsed(chunks: AsyncIterator[Chunk], parsers: OutputParsers) -> AsyncIterator[Chunk]:
    enforced: list[str] = []
    async for chunk in chunks:
        final = chunk.finish_reason is not None
        if parsers.options.enforced_tool_calls:  # the grammar starts after any reasoning
            thought, content = parsers.think(chunk.text, final)
            enforced.append(content)
            keep = thought if parsers.options.include_reasoning else ""
            out = replace(chunk, text="", reasoning=keep)
            if final:
                out.tool_calls = parsers.enforced("".join(enforced)) or None
                if out.tool_calls is None:  # cut (max_tokens) before the call closed
                    out.text = "".join(enforced)
        else:
            thought, content, calls = parsers.feed(chunk.text, final)
            keep = thought if parsers.options.include_reasoning else ""
            out = replace(chunk, text=content, reasoning=keep, tool_calls=calls)
        if final and parsers.called and chunk.finish_reason is FinishReason.STOP:
            out.finish_reason = FinishReason.TOOL_CALLS
        yield out
