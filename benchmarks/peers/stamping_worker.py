"""A stand-in for a vlmserve worker that stamps its answer with when things happened.

    python -m uvicorn stamping_worker:app --app-dir benchmarks/peers --http httptools --port 8000

``/health`` says what a vlmserve worker says (so a gateway passes its streams through as
bytes). A chat POST gets a stream of a role chunk; after ``PREFILL_S`` (a prefill) one content
chunk whose text is ``"<arrived> <sent>"``; a finish chunk; ``[DONE]``. The stamps are
``time.monotonic_ns()`` when the request's head reached this process and when the content
chunk was handed to the socket. The clock is the machine's, so a client on the same machine
subtracts its own stamps from them (``benchmarks/hops.py``): the request's path to the worker,
and the first token's path back.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

__all__ = ["PREFILL_S", "app", "content_chunk", "stamps"]

PREFILL_S = 0.002
HEALTH = json.dumps({"ok": True, "modelReady": True, "resumableStreams": True}).encode()
_STREAM_HEADERS = [(b"content-type", b"text/event-stream"), (b"x-session-id", b"stamped")]


def content_chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    chunk = {
        "id": "chatcmpl-stamped",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [choice],
    }
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


def stamps(line: str) -> tuple[int, int] | None:
    """``(arrived, sent)`` from an SSE line of the stamped content chunk, else None."""
    if not line.startswith("data: {"):
        return None
    choices = json.loads(line[6:]).get("choices") or [{}]
    text = choices[0].get("delta", {}).get("content") or ""
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    arrived = time.monotonic_ns()
    while (await receive()).get("more_body"):
        pass
    if scope["path"] != "/v1/chat/completions":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": HEALTH})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _STREAM_HEADERS})
    await send(
        {
            "type": "http.response.body",
            "more_body": True,
            "body": content_chunk({"role": "assistant", "content": ""}),
        }
    )
    await asyncio.sleep(PREFILL_S)
    sent = time.monotonic_ns()
    await send(
        {
            "type": "http.response.body",
            "more_body": True,
            "body": content_chunk({"content": f"{arrived} {sent}"}),
        }
    )
    await send(
        {"type": "http.response.body", "more_body": True, "body": content_chunk({}, finish="stop")}
    )
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
