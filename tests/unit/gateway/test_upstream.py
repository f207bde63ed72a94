"""The openai proxy backend against fake upstreams on real sockets (``tests/upstreams.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from upstreams import FakeUpstreams
from vlmserve.engine.types import FinishReason, GenerateRequest, SamplingParams
from vlmserve.errors import Overloaded, ServiceUnavailable
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig, UpstreamError
from vlmserve.gateway.upstream_http import UpstreamTimeout
from vlmserve.gateway.upstream_wire import ChunkReader

A, B = "http://a.test", "http://b.test"
_OPEN: list[Any] = []  # fakes and backends a test opened: closed after it


@pytest.fixture(autouse=True)
async def _close_opened() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().aclose()


async def start(
    handler: Callable[[httpx.Request], Any], config: UpstreamConfig, name: str
) -> tuple[UpstreamBackend, FakeUpstreams]:
    """A backend routing to fake replicas named by ``config.base_urls``."""
    fake = await FakeUpstreams.start(handler, *config.base_urls)
    _OPEN.append(fake)
    config.base_urls = fake.real(*config.base_urls)
    b = UpstreamBackend(name, config)
    _OPEN.append(b)
    await b.aload()
    return b, fake


def sse(*pieces: str, finish: str = "stop", usage: tuple[int, int] = (7, 3)) -> bytes:
    lines = []
    for i, text in enumerate(pieces):
        delta = {"content": text} if i else {"role": "assistant", "content": text}
        lines.append({"id": "chatcmpl-up", "choices": [{"index": 0, "delta": delta}]})
    lines.append(
        {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    )
    lines.append(
        {
            "id": "chatcmpl-up",
            "choices": [],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
        }
    )
    out = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
    return out.encode()


class Broken(httpx.AsyncByteStream):
    """A body that sends ``head`` and then breaks like a killed server."""

    def __init__(self, head: bytes = b"", gate: asyncio.Event | None = None):
        self.head, self.gate = head, gate

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        if self.gate is not None:
            await self.gate.wait()
        raise httpx.ReadError("connection reset by peer")


class Upstreams:
    """Fake replicas: ``routes[(base, path)] -> handler``; records every request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], dict[str, str]]] = []
        self.chat: dict[str, Callable[[httpx.Request], httpx.Response]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        body = json.loads(request.content) if request.content else {}
        self.calls.append((base, request.url.path, body, dict(request.headers)))
        if request.url.path == "/health":
            return httpx.Response(200, json={"ok": True})
        if request.url.path == "/v1/chat/completions":
            return self.chat[base](request)
        if request.url.path.startswith("/v1/cancel/"):
            return httpx.Response(200, json={"cancelled": True})
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": f"from {base}"})
        return httpx.Response(404, json={"error": {"message": "nope", "type": "not_found_error"}})

    def posts(self, path: str = "/v1/chat/completions") -> list[str]:
        return [base for base, p, _, _ in self.calls if p == path]


def ok(*pieces: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda r: httpx.Response(
        200, content=sse(*pieces), headers={"content-type": "text/event-stream"}
    )


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def backend(ups: Upstreams, urls: list[str], **policy: Any) -> UpstreamBackend:
    config = UpstreamConfig(
        model="upstream-name",
        base_urls=urls,
        api_key="gw-secret",
        health_interval=0,
        preflight=False,
        policy=PoolPolicy(**policy),
    )
    b, _ = await start(ups, config, "gw-name")
    return b


def request(**raw: Any) -> GenerateRequest:
    body = {"model": "gw-name", "messages": [{"role": "user", "content": "hi"}], **raw}
    return GenerateRequest("r1", [], SamplingParams(), raw=body)


async def run(b: UpstreamBackend, req: GenerateRequest | None = None) -> list[Any]:
    prepared = await b.prepare(req or request())
    return [c async for c in b.generate(prepared)]


async def test_stream_is_translated_and_body_rewritten_for_the_upstream() -> None:
    ups = Upstreams()
    ups.chat[A] = ok("Hel", "lo")
    b = await backend(ups, [A])
    chunks = await run(
        b, request(session_id="mine", stream=False, response_format={"type": "json_object"})
    )
    assert [c.text for c in chunks] == ["Hel", "lo", ""]
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (7, 3)
    _, _, sent, headers = next(c for c in ups.calls if c[1] == "/v1/chat/completions")
    assert sent["model"] == "upstream-name"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["response_format"] == {"type": "json_object"}
    assert "session_id" not in sent
    assert headers["authorization"] == "Bearer gw-secret"  # the gateway's key, not a client's
    await b.aclose()


async def test_upstream_4xx_is_passed_on_with_its_status_and_not_retried() -> None:
    ups = Upstreams()
    error = {
        "error": {
            "message": "max_tokens too big",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "context_length_exceeded",
        }
    }
    ups.chat[A] = ups.chat[B] = lambda r: httpx.Response(400, json=error)
    b = await backend(ups, [A, B])
    with pytest.raises(UpstreamError) as info:
        await b.prepare(request())
    assert info.value.status_code == 400
    assert (info.value.message, info.value.param, info.value.code) == (
        "max_tokens too big",
        "max_tokens",
        "context_length_exceeded",
    )
    assert len(ups.posts()) == 1
    assert b.pool.admitted == 0 and all(r.outstanding == 0 for r in b.pool.replicas)


@pytest.mark.parametrize("failure", ["refused", "500"])
async def test_failure_before_first_byte_is_retried_on_another_replica(failure: str) -> None:
    ups = Upstreams()
    ups.chat[A] = refused if failure == "refused" else (lambda r: httpx.Response(500, text="boom"))
    ups.chat[B] = ok("fine")
    b = await backend(ups, [A, B])
    for _ in range(2):
        assert "".join(c.text for c in await run(b)) == "fine"
    assert ups.posts().count(B) == 2
    assert b.pool.replicas[0].failures >= 1


async def test_stream_that_breaks_before_its_first_chunk_is_retried() -> None:
    ups = Upstreams()
    ups.chat[A] = lambda r: httpx.Response(200, stream=Broken())
    ups.chat[B] = ok("second")
    b = await backend(ups, [A, B])
    assert "".join(c.text for c in await run(b)) == "second"


async def test_stream_that_breaks_after_a_chunk_is_not_retried() -> None:
    ups = Upstreams()
    first = sse("partial")[: sse("partial").index(b"\n\n") + 2]
    ups.chat[A] = ups.chat[B] = lambda r: httpx.Response(200, stream=Broken(first))
    b = await backend(ups, [A, B])
    prepared = await b.prepare(request())
    got = []
    with pytest.raises(ServiceUnavailable, match="broke off") as info:
        async for chunk in b.generate(prepared):
            got.append(chunk.text)
    assert got == ["partial"] and info.value.code == "upstream_error"
    assert b.pool.replicas[0].reason.endswith("mid-stream")
    assert len(ups.posts()) == 1
    assert b.pool.admitted == 0


async def test_ejected_replica_gets_no_traffic_and_none_left_is_503() -> None:
    ups = Upstreams()
    ups.chat[A] = refused
    ups.chat[B] = ok("x")
    b = await backend(ups, [A, B], max_failures=2, eject_seconds=60)
    for _ in range(4):
        await run(b)
    assert ups.posts().count(A) == 2  # ejected after 2 consecutive failures
    ups.chat[B] = refused
    with pytest.raises(ServiceUnavailable) as info:
        await b.prepare(request())
    assert info.value.retry_after >= 1
    assert b.pool.admitted == 0


async def test_queue_full_is_429() -> None:
    ups = Upstreams()
    gate = asyncio.Event()
    ups.chat[A] = lambda r: httpx.Response(200, stream=Broken(gate=gate))
    b = await backend(ups, [A], max_queued=1)
    held = await b.prepare(request())
    with pytest.raises(Overloaded):
        await b.prepare(request())
    await b.discard(held)
    ups.chat[A] = ok("room")
    assert "".join(c.text for c in await run(b)) == "room"


async def test_closing_the_stream_early_cancels_it_upstream() -> None:
    ups = Upstreams()
    gate = asyncio.Event()
    head = sse("one")[: sse("one").index(b"\n\n") + 2]
    ups.chat[A] = lambda r: httpx.Response(200, stream=Broken(head, gate))
    b = await backend(ups, [A])
    gen = b.generate(await b.prepare(request()))
    assert (await gen.__anext__()).text == "one"
    await gen.aclose()
    for _ in range(50):
        if ups.posts("/v1/cancel/chatcmpl-up"):
            break
        await asyncio.sleep(0.01)
    assert ups.posts("/v1/cancel/chatcmpl-up") == [A]
    assert b.pool.admitted == 0 and b.pool.replicas[0].outstanding == 0


async def test_forward_returns_the_upstreams_json() -> None:
    ups = Upstreams()
    b = await backend(ups, [A])
    assert await b.forward("/generate", {"model": "x"}) == {"text": f"from {A}"}


async def test_failing_health_check_takes_replica_out() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        return httpx.Response(503 if r.url.host == "a.test" else 200, json={})

    config = UpstreamConfig("m", [A, B], health_interval=0, preflight=False)
    b, fake = await start(handler, config, "m")
    states = {fake.fake(r["url"]): r["healthy"] for r in b.describe()["replicas"]}
    assert states == {A: False, B: True}
    assert "GET /v1/models answered 503" in b.describe()["replicas"][0]["reason"]


def test_chunk_reader_keeps_finish_for_the_usage_chunk() -> None:
    reader = ChunkReader()
    out = []
    for line in sse("a", "b", finish="length", usage=(5, 2)).decode().splitlines():
        out += reader.feed(line)
    assert [c.text for c in out] == ["a", "b", ""]
    assert out[-1].finish_reason is FinishReason.LENGTH and out[-1].completion_tokens == 2
    assert reader.upstream_id == "chatcmpl-up"


class Stall(httpx.AsyncByteStream):
    """A body that sends ``head`` and then nothing, its connection kept open."""

    def __init__(self, head: bytes = b""):
        self.head = head

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        await asyncio.sleep(3600)


async def test_an_upstream_silent_past_read_timeout_is_504_and_not_retried() -> None:
    ups = Upstreams()

    async def no_answer(r: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    ups.chat[A], ups.chat[B] = no_answer, ok("fine")
    config = UpstreamConfig(
        model="up", base_urls=[A, B], read_timeout=0.3, health_interval=0, preflight=False
    )
    b, _ = await start(ups, config, "m")
    with pytest.raises(UpstreamTimeout) as info:
        await run(b)
    assert info.value.status_code == 504 and ups.posts() == [A]  # it may be running there
    assert info.value.code == "upstream_timeout"
    assert b.pool.admitted == 0


async def test_a_stream_that_goes_silent_mid_body_is_504() -> None:
    ups = Upstreams()
    head = sse("one")[: sse("one").index(b"\n\n") + 2]
    ups.chat[A] = lambda r: httpx.Response(200, stream=Stall(head))
    config = UpstreamConfig(
        model="up", base_urls=[A], read_timeout=0.3, health_interval=0, preflight=False
    )
    b, _ = await start(ups, config, "m")
    got = []
    with pytest.raises(UpstreamTimeout):
        async for chunk in b.generate(await b.prepare(request())):
            got.append(chunk.text)
    assert got == ["one"] and b.pool.admitted == 0


async def test_a_closed_port_is_retried_on_the_next_replica() -> None:
    ups = Upstreams()
    ups.chat[B] = ok("fine")
    config = UpstreamConfig(model="up", base_urls=[A, B], health_interval=0, preflight=False)
    b, fake = await start(ups, config, "m")
    await fake.stop(A)  # healthy when checked, gone now: its port refuses connections
    assert "".join(c.text for c in await run(b)) == "fine"
    assert ups.posts() == [B] and b.pool.replicas[0].failures == 1


async def test_forward_of_a_non_json_answer_is_502() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy login</html>")

    config = UpstreamConfig(model="up", base_urls=[A], health_interval=0, preflight=False)
    b, _ = await start(handler, config, "m")
    with pytest.raises(UpstreamError) as info:
        await b.forward("/generate", {})
    assert info.value.status_code == 502 and b.pool.admitted == 0
