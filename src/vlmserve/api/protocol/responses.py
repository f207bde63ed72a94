"""OpenAI response shapes for chat completions (plain dicts: built per token, kept cheap)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CompletionIds", "chunk_json", "completion_body", "sse_json", "usage"]


@dataclass(slots=True, frozen=True)
class CompletionIds:
    id: str
    created: int
    model: str


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk_json(
    ids: CompletionIds,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
) -> str:
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    body: dict[str, Any] = {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return sse_json(body)


# JSON leaves these raw, but many SSE readers (httpx's aiter_lines, Python's splitlines) treat
# them as line breaks and would cut an event in two; escaped, they are still the same JSON.
_LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(body: Any) -> str:
    """Compact UTF-8 JSON that is always one line for every SSE reader."""
    return json.dumps(body, ensure_ascii=False).translate(_LINE_SEPARATORS)


def completion_body(
    ids: CompletionIds, text: str, finish_reason: str, usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }
