"""The ``n`` choices of one chat completion, gathered (JSON) or streamed (SSE chunks).

Engine chunks carry their choice's ``index`` and, when asked for, the OpenAI
``logprobs.content`` items of their tokens. A JSON answer lists the choices by index, each
with its own finish reason and ``logprobs`` (``{"content": [...]}``, or None when not asked
for); its usage counts the prompt once and the completion tokens of every choice. A stream
sends each choice's deltas under its index, and a usage chunk at the end with those sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.api.protocol.responses import CompletionIds, chunk_json, completion_body, usage
from vlmserve.engine.types import Chunk
from vlmserve.errors import VlmserveError

__all__ = ["Answer", "Usage", "choice_chunk"]


def _untracked(item: dict[str, Any]) -> dict[str, Any]:
    """A ``logprobs.content`` item with tuples for its lists (the same JSON). A tuple or dict
    of atoms is untracked by the garbage collector after its first young collection, so the
    ~40 containers of each token with 20 alternatives drop out of every later full
    collection: a large non-streamed answer's items no longer make those scans take seconds
    (each one a stall of the event loop)."""
    out = {**item, "bytes": tuple(item.get("bytes") or ())}
    top = item.get("top_logprobs")
    if top is not None:
        out["top_logprobs"] = tuple({**t, "bytes": tuple(t.get("bytes") or ())} for t in top)
    return out


@dataclass(slots=True)
class _Choice:
    """One choice of a non-streamed answer, gathered chunk by chunk."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.reasoning.append(chunk.reasoning)
        for delta in chunk.tool_calls or []:
            self._merge(delta)
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(_untracked(item) for item in chunk.logprobs)
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

    def add(self, chunk: Chunk) -> None:
        self.prompt = chunk.prompt_tokens
        self.completion[chunk.index] = chunk.completion_tokens
        if chunk.cached_tokens is not None and chunk.index == 0:
            self.cached = chunk.cached_tokens

    def body(self) -> dict[str, Any]:
        return usage(self.prompt, sum(self.completion.values()), self.cached)


@dataclass(slots=True)
class Answer:
    """A non-streamed answer: its choices by index."""

    choices: dict[int, _Choice] = field(default_factory=dict)
    counts: Usage = field(default_factory=Usage)

    def add(self, chunk: Chunk) -> None:
        self.choices.setdefault(chunk.index, _Choice()).add(chunk)
        self.counts.add(chunk)

    def body(self, ids: CompletionIds) -> dict[str, Any]:
        """The ``chat.completion`` (``completion_body``'s shape, one entry per choice)."""
        bodies = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            last = choice.last
            if last is None or last.finish_reason is None:
                raise VlmserveError("generation ended without a result")
            one = completion_body(ids, "".join(choice.text), last.finish_reason.value,
                                  self.counts.body(), reasoning="".join(choice.reasoning) or None,
                                  tool_calls=choice.calls or None)  # fmt: skip
            entry = one["choices"][0]
            entry["index"] = index
            entry["logprobs"] = None if choice.logprobs is None else {"content": choice.logprobs}
            bodies.append(one)
        if not bodies:
            raise VlmserveError("generation ended without a result")
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        return body


def choice_chunk(
    ids: CompletionIds,
    index: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> str:
    """A ``chat.completion.chunk`` for choice ``index`` (``protocol.responses.chunk_json``)."""
    return chunk_json(ids, delta, finish_reason, usage_, index=index, logprobs=logprobs)
