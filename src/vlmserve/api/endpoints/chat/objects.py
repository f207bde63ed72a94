"""OpenAI response shapes for chat completions (plain dicts: built per token, kept cheap)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["CompletionIds", "chunk_json", "completion_body", "delta_of", "sse_json", "usage"]


@dataclass(slots=True, frozen=True)
class CompletionIds:
    id: str
    created: int
    model: str


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` when the model caches
    prefixes (``cached``: prompt tokens whose K/V came from the prefix cache)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chunk_json(
    ids: CompletionIds,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    *,
    index: int = 0,
    logprobs: list[dict[str, Any]] | None = None,
    metrics: dict[str, Any] | None = None,
) -> str:
    """A ``chat.completion.chunk`` for choice ``index`` (``delta`` None: a usage-only chunk
    with no choices, which may carry the request's ``metrics``)."""
    choices = []
    if delta is not None:
        lp = None if logprobs is None else {"content": logprobs}
        choices = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]
    body: dict[str, Any] = {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    if metrics is not None:
        body["metrics"] = metrics
    return sse_json(body)


# JSON leaves these raw, but many SSE readers (httpx's aiter_lines, Python's splitlines) treat
# them as line breaks and would cut an event in two; escaped, they are still the same JSON.
_LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(body: Any) -> str:
    """Compact UTF-8 JSON that is always one line for every SSE reader. orjson (about 10x
    faster than ``json`` per chunk, measured) where it can encode the value; ``json`` for what
    it refuses (integers past 64 bits, non-string keys)."""
    try:
        text = orjson.dumps(body).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return text.translate(_LINE_SEPARATORS)


def completion_body(
    ids: CompletionIds,
    text: str,
    finish_reason: str,
    usage_: dict[str, int],
    *,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion``. A thinking model's reasoning is in ``reasoning`` and, for
    clients written against the older name (SGLang, vLLM before late 2025), in
    ``reasoning_content``; tool calls make ``content`` None when there is no text."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning"] = message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
        message["content"] = text or None
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": usage_,
    }


def delta_of(
    text: str, reasoning: str, tool_calls: list[dict[str, Any]] | None
) -> dict[str, Any] | None:
    """One chunk's ``delta`` (None when it carries nothing)."""
    delta: dict[str, Any] = {}
    if reasoning:
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    if text:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta or None
