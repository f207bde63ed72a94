"""The ``n`` choices of one chat completion, gathered (JSON) or streamed (SSE chunks).

Engine chunks carry their choice's ``index`` and, when asked for, the OpenAI
``logprobs.content`` items of their tokens. A JSON answer lists the choices by index, each
with its own finish reason and ``logprobs`` (``{"content": [...]}``, or None when not asked
for); its usage counts the prompt once and the completion tokens of every choice. A stream
sends each choice's deltas under its index, and a usage chunk at the end with those sums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from vlmserve.api.endpoints.chat.objects import CompletionIds, chunk_json, completion_body, usage
from vlmserve.engine.types import Chunk
from vlmserve.errors import VlmserveError

__all__ = ["Answer", "Usage", "choice_chunk"]


def _item_json(item: dict[str, Any]) -> bytes:
    """One ``logprobs.content`` item as JSON, kept as bytes until the answer is written: a
    token with 20 alternatives is ~40 dicts and lists, and hundreds of thousands of such
    objects made the garbage collector's full passes hold the event loop for up to a second
    each; a bytes object is never scanned."""
    try:
        return orjson.dumps(item)
    except orjson.JSONEncodeError:  # an integer wider than 64 bits
        return json.dumps(item, separators=(",", ":")).encode()


@dataclass(slots=True)
class _Choice:
    """One choice of a non-streamed answer, gathered chunk by chunk."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[bytes] | None = None  # each item's JSON (``_item_json``)
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.reasoning.append(chunk.reasoning)
        for delta in chunk.tool_calls or []:
            self._merge(delta)
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(_item_json(item) for item in chunk.logprobs)
        self.last = chunk

    def _merge(self, delta: dict[str, Any]) -> None:
        """Streaming deltas -> whole calls: the first names the call, later ones add to its
        ``arguments``."""
        index = delta.get("index", len(self.calls))
        if index >= len(self.calls):
            call = {k: v for k, v in delta.items() if k != "index"}
            call["function"] = dict(call.get("function") or {})
            self.calls.append(call)
            return
        more = (delta.get("function") or {}).get("arguments") or ""
        function = self.calls[index]["function"]
        function["arguments"] = (function.get("arguments") or "") + more


@dataclass(slots=True)
class Usage:
    """Token counts of a request's choices: the prompt once, completions summed."""

    prompt: int = 0
    completion: dict[int, int] = field(default_factory=dict)  # by choice index
    cached: int | None = None  # prompt tokens from the prefix cache (None: not caching)
    # a continued stream reports the cache hits of the request the client sent (stored with
    # its first chunk), not those of the continuation's own prompt
    cached_known: bool = False

    def add(self, chunk: Chunk) -> None:
        self.prompt = chunk.prompt_tokens
        self.completion[chunk.index] = chunk.completion_tokens
        if chunk.cached_tokens is not None and chunk.index == 0 and not self.cached_known:
            self.cached = chunk.cached_tokens

    def body(self) -> dict[str, Any]:
        return usage(self.prompt, sum(self.completion.values()), self.cached)


@dataclass(slots=True)
class Answer:
    """A non-streamed answer: its choices by index."""

    choices: dict[int, _Choice] = field(default_factory=dict)
    counts: Usage = field(default_factory=Usage)
    timings: dict[str, float] | None = None  # choice 0's (``Chunk.timings``)

    def add(self, chunk: Chunk) -> None:
        self.choices.setdefault(chunk.index, _Choice()).add(chunk)
        self.counts.add(chunk)
        if chunk.timings is not None and chunk.index == 0:
            self.timings = chunk.timings

    def body(self, ids: CompletionIds) -> dict[str, Any]:
        """The ``chat.completion`` (``completion_body``'s shape, one entry per choice)."""
        bodies = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            last = choice.last
            if last is None or last.finish_reason is None:
                raise VlmserveError("generation ended without a result")
            one = completion_body(
                ids,
                "".join(choice.text),
                last.finish_reason.value,
                self.counts.body(),
                reasoning="".join(choice.reasoning) or None,
                tool_calls=choice.calls or None,
            )
            entry = one["choices"][0]
            entry["index"] = index
            if choice.logprobs is None:
                entry["logprobs"] = None
            else:
                entry["logprobs"] = {"content": _content(choice.logprobs)}
            bodies.append(one)
        if not bodies:
            raise VlmserveError("generation ended without a result")
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        return body


def _content(items: list[bytes]) -> list[orjson.Fragment]:
    """The items, each written as is by orjson (``api.json_response``; a batch's result line:
    ``files_store``). A list, not one joined array, so ``json_response`` sees its length and
    writes it in pieces off the event loop: one 6 MiB fragment per choice was written whole,
    on the loop, in a single call."""
    return [orjson.Fragment(item) for item in items]


def choice_chunk(
    ids: CompletionIds,
    index: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    metrics: dict[str, Any] | None = None,
) -> str:
    """A ``chat.completion.chunk`` for choice ``index`` (``protocol.responses.chunk_json``)."""
    return chunk_json(
        ids, delta, finish_reason, usage_, index=index, logprobs=logprobs, metrics=metrics
    )
