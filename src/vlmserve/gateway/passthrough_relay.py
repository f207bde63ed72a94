"""The byte relay of the gateway's pass-through (``gateway/passthrough.py``): an upstream answer to
the client as it comes, whole SSE messages at a time, and what it tells the metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from starlette.types import Message, Receive, Send

from vlmserve.engine.protocol import PassedAnswer
from vlmserve.errors import VlmserveError
from vlmserve.streaming.events import error_emit

__all__ = [
    "GenerationMetrics",
    "Observed",
    "read_body",
    "relay",
    "relay_whole",
    "replay",
    "unless_gone",
]

_ANSWER_HEADERS = (
    "content-type",
    "cache-control",
    "x-accel-buffering",
    "x-session-id",
    "retry-after",
)
_FINISH = re.compile(rb'"finish_reason":"([a-z_]{1,32})"')
_USAGE = re.compile(rb'"usage":\{"prompt_tokens":(\d+),"completion_tokens":(\d+)')
# a delta whose first output field is not empty (after the role, on a stream's first chunk)
_TOKEN = re.compile(
    rb'"delta":\{(?:"role":"assistant",)?"(?:content|reasoning_content|reasoning)":"[^"]'
)


class GenerationMetrics(Protocol):
    """What a passed request tells the metrics (the API's ``Metrics``)."""

    def observe_ttft(self, model: str, seconds: float) -> None: ...

    def observe_generation(
        self, model: str, *, prompt_tokens: int, output_tokens: int, ttft: float, total: float
    ) -> None: ...

    def observe_finished(self, model: str, done: dict[str, Any]) -> None: ...


class Observed:
    """The generation metrics of a passed request, from its bytes: the time to its first
    content token, and its token counts from the usage the answer ends with (a streamed
    client that asked for no usage chunk leaves only the TTFT); under vLLM's names too, with
    its finish reason, prefill as the time to the first token and decode as the rest."""

    __slots__ = ("finish", "first", "metrics", "model", "started", "usage")

    def __init__(self, metrics: GenerationMetrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        self.started = time.perf_counter()
        self.first: float | None = None
        self.usage: tuple[bytes, bytes] | None = None  # the last (prompt, completion) seen
        self.finish = "stop"

    def __call__(self, events: bytes) -> None:
        if self.first is None and _TOKEN.search(events):
            self.first = time.perf_counter() - self.started
        if b'"finish_reason":"' in events and (reasons := _FINISH.findall(events)):
            self.finish = reasons[-1].decode()
        if b'"usage":{' in events and (counts := _USAGE.findall(events)):
            self.usage = counts[-1]

    def finished(self) -> None:
        total = time.perf_counter() - self.started
        if self.usage is None:
            if self.first is not None:
                self.metrics.observe_ttft(self.model, self.first)
            return
        prompt, output = (int(n) for n in self.usage)
        ttft = total if self.first is None else self.first
        self.metrics.observe_generation(
            self.model, prompt_tokens=prompt, output_tokens=output, ttft=ttft, total=total
        )
        phases = {"media": 0.0, "queue": 0.0, "vision": 0.0, "prefill": ttft}
        done = {
            "prompt_tokens": prompt,
            "output_tokens": output,
            "finish_reason": self.finish,
            "max_tokens": output,  # the passed body is not read: what it produced
            "n": 1,
            "ttft": ttft,
            "timings": {**phases, "decode": total - ttft, "e2e": total},
        }
        self.metrics.observe_finished(self.model, done)


async def unless_gone(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """``work``, cancelled when the client disconnects first."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def relay_whole(
    response: PassedAnswer,
    send: Send,
    rename: tuple[bytes, bytes] | None,
    see: Callable[[bytes], Any],
    ended: Callable[[], None],
) -> bool:
    """A JSON answer, read to its end before its status goes out: an upstream that breaks off
    raises (``VlmserveError``) while the client can still get an error answer."""
    body = b"".join([data async for data in response.chunks()])
    see(body)
    if rename is not None:
        body = body.replace(*rename)
    ended()
    await send(
        {"type": "http.response.start", "status": response.status, "headers": _headers(response)}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return True


def _headers(response: PassedAnswer) -> list[tuple[bytes, bytes]]:
    return [
        (k.encode(), v.encode())
        for k in _ANSWER_HEADERS
        if (v := response.headers.get(k)) is not None
    ]


async def relay(
    response: PassedAnswer,
    receive: Receive,
    send: Send,
    rename: tuple[bytes, bytes] | None,
    see: Callable[[bytes], Any],
    ended: Callable[[], None] | None = None,
) -> bool:
    """The answer's status, its headers that matter to a client, and its body event by event
    (whole SSE messages, so a rename never meets half a name). True when read to its end; False
    when the client left first (the worker keeps the stream for a resume) or the upstream broke
    off (the client gets an error event). ``ended``: called once read to its end."""
    await send(
        {"type": "http.response.start", "status": response.status, "headers": _headers(response)}
    )
    gone = asyncio.ensure_future(_disconnected(receive))
    pending = b""
    try:
        async for data in response.chunks():
            if gone.done():
                return False
            pending += data
            cut = pending.rfind(b"\n\n") + 2
            if cut < 2:
                continue
            events, pending = pending[:cut], pending[cut:]
            see(events)
            if rename is not None:
                events = events.replace(*rename)
            await send({"type": "http.response.body", "body": events, "more_body": True})
    except VlmserveError:  # the upstream broke off or went silent
        await send({"type": "http.response.body", "body": _broken(), "more_body": False})
        return False
    finally:
        gone.cancel()
    if pending:  # a body that is not SSE (a JSON answer or error) comes whole at its end
        see(pending)
        pending = pending if rename is None else pending.replace(*rename)
    if ended is not None:
        ended()  # before the last byte: a client that then reads /metrics sees this request
    await send({"type": "http.response.body", "body": pending, "more_body": False})
    return True


def _broken() -> bytes:
    emit = error_emit(
        "the upstream replica broke off the stream; resume it or retry", "upstream_error"
    )
    return f"data: {emit.data}\n\ndata: [DONE]\n\n".encode()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """The body once more, for the full path; then the client's own messages (disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
