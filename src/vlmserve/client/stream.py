"""One streaming chat completion, timed chunk by chunk (TTFT, inter-token gaps, end to end)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

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


class _Lines:
    """SSE lines to ``(event name, data)`` events: the name is ``message`` unless the server
    sets one; ``id:`` and comment lines are skipped."""

    def __init__(self) -> None:
        self.name, self.data = "message", list[bytes]()

    def feed(self, lines: list[bytes]) -> list[tuple[str, bytes]]:
        events = []
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:
                if self.data:
                    events.append((self.name, b"\n".join(self.data)))
                self.name, self.data = "message", []
            elif line.startswith(b"data:"):
                self.data.append(line[5:].removeprefix(b" "))
            elif line.startswith(b"event:"):
                self.name = line[6:].strip().decode("utf-8", "replace")
        return events


async def _events(response: httpx.Response) -> AsyncIterator[tuple[float, str, bytes]]:
    """``(arrival time, event name, data)`` per SSE event.

    The time is when the bytes holding the event arrived, taken before any splitting or
    decoding, so a token's time is the network's and not this client's parsing (vLLM's
    client, on aiohttp, times chunks the same way). Reads both wires of vlmserve (and any
    OpenAI-compatible server): ``data:`` lines only, or with ``id:`` lines and
    ``event: error``; ``_read`` also takes an error payload, ``{"error": {...}}``, without an
    event name (OpenAI, vLLM). Lines end in ``\n`` or ``\r\n``; a last event without its
    blank line still counts."""
    lines, pending = _Lines(), b""
    now = time.perf_counter()
    async for piece in response.aiter_bytes():
        now = time.perf_counter()
        *complete, pending = (pending + piece).split(b"\n")
        for name, data in lines.feed(complete):
            yield now, name, data
    for name, data in lines.feed([pending, b""]):
        yield now, name, data


async def _read(response: httpx.Response, record: RequestRecord, started: float) -> None:
    last: float | None = None
    tokens = 0
    done = False
    async for now, name, data in _events(response):
        # after [DONE] the body is read to its end: a response closed before its last bytes
        # closes its connection, and the next request would pay for a new one in its TTFT
        done = done or data == b"[DONE]"
        if done:
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
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
