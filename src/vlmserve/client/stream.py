"""One streaming chat completion, timed chunk by chunk (TTFT, inter-token gaps, end to end)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from vlmserve.client.http import error_text
from vlmserve.client.stats import RequestRecord

__all__ = ["carries_token", "stream_chat"]


_OUTPUT = ("content", "reasoning_content", "reasoning", "tool_calls")


def carries_token(chunk: dict[str, Any]) -> bool:
    """Whether a ``chat.completion.chunk`` holds generated output (its text may be empty while a
    multi-byte character is held back); the role-only opener (vLLM's, some servers') and the
    finish chunk don't. A first chunk with the role and the first token (vlmserve's) does."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta") or {}
    if "role" in delta and not any(delta.get(k) for k in _OUTPUT):
        return False
    return any(k in delta for k in _OUTPUT)


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """``(event name, data)`` per SSE event; the name is ``message`` unless the server sets one.

    Reads both wires of vlmserve (and any OpenAI-compatible server): ``data:`` lines only, or
    with ``id:`` lines (skipped) and ``event: error``; ``_read`` also takes an error payload,
    ``{"error": {...}}``, without an event name (OpenAI, vLLM)."""
    name = "message"
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            name = line[6:].strip()
    if data:
        yield name, "\n".join(data)


async def _read(response: httpx.Response, record: RequestRecord, started: float) -> None:
    last: float | None = None
    tokens = 0
    async for name, data in _events(response):
        now = time.perf_counter()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            record.error, record.message = "stream_error", f"not JSON: {data[:120]!r}"
            return
        if name == "error" or (isinstance(chunk, dict) and "error" in chunk):
            record.error, record.message = "stream_error", error_text(200, data)
            return
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if isinstance(usage, dict):
            record.usage_seen = True
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.output_tokens = int(usage.get("completion_tokens") or 0)
        if isinstance(chunk, dict) and carries_token(chunk):
            tokens += 1
            if last is None:
                record.ttft = now - started
            else:
                record.itl.append(now - last)
            last = now
    if not record.usage_seen:
        record.output_tokens = tokens  # best effort; the report counts these as usage_missing
    if last is None:
        record.ttft = time.perf_counter() - started


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestRecord:
    """POST ``body`` (``stream: true``) and time it; a failure is recorded, never raised."""
    record = RequestRecord()
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = str(response.status_code)
                record.message = error_text(response.status_code, await response.aread())
            else:
                await _read(response, record, started)
    except httpx.TimeoutException as exc:
        record.error, record.message = "timeout", f"{type(exc).__name__}: {exc}"
    except httpx.TransportError as exc:
        record.error, record.message = "connection", f"{type(exc).__name__}: {exc}"
    record.e2e = time.perf_counter() - started
    return record
