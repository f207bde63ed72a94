"""The proxy backend's view of its replicas: health checks, failure reasons, closing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from upstreams import FakeUpstreams
from vlmserve.engine.types import GenerateRequest, SamplingParams
from vlmserve.errors import ServiceUnavailable
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig

pytestmark = pytest.mark.timeout(60)
A, B = "http://a.test", "http://b.test"
Handler = Callable[[httpx.Request], Any]


@pytest.fixture
async def opened() -> AsyncIterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        await thing.aclose()


async def start(
    opened: list[Any], handler: Handler, *names: str, **kw: Any
) -> tuple[UpstreamBackend, FakeUpstreams]:
    fake = await FakeUpstreams.start(handler, *names)
    opened.append(fake)
    kw.setdefault("health_interval", 0)
    config = UpstreamConfig(model="up", base_urls=fake.real(*names), preflight=False, **kw)
    backend = UpstreamBackend("gw", config)
    opened.append(backend)
    await backend.aload()
    return backend, fake


def states(backend: UpstreamBackend, fake: FakeUpstreams) -> dict[str, tuple[bool, Any]]:
    return {
        fake.fake(r["url"]): (r["healthy"], r["reason"]) for r in backend.describe()["replicas"]
    }


def request() -> GenerateRequest:
    body = {"model": "gw", "messages": [{"role": "user", "content": "hi"}]}
    return GenerateRequest("r", [], SamplingParams(), raw=body)


async def test_health_is_2xx_on_health_else_on_models(opened: list[Any]) -> None:
    answers = {
        (A, "/health"): 204,
        (B, "/health"): 404,
        (B, "/v1/models"): 200,
        ("http://c.test", "/health"): 302,
        ("http://c.test", "/v1/models"): 300,
    }

    def handler(r: httpx.Request) -> httpx.Response:
        return httpx.Response(answers[(f"http://{r.url.host}", r.url.path)])

    backend, fake = await start(opened, handler, A, B, "http://c.test")
    seen = states(backend, fake)
    assert seen[A] == (True, None) and seen[B] == (True, None)
    assert seen["http://c.test"] == (False, "GET /v1/models answered 300")


async def test_an_unreachable_replica_is_not_asked_twice(opened: list[Any]) -> None:
    asked: list[str] = []

    def handler(r: httpx.Request) -> httpx.Response:
        asked.append(r.url.path)
        raise httpx.ConnectError("reset")

    backend, fake = await start(opened, handler, A)
    healthy, reason = states(backend, fake)[A]
    assert not healthy and reason.startswith("GET /health: UpstreamDisconnected")
    assert "/v1/models" not in asked  # it would fail the same way


async def test_a_hanging_health_check_ends_at_connect_timeout(opened: list[Any]) -> None:
    async def hang(r: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    began = asyncio.get_running_loop().time()
    backend, fake = await start(opened, hang, A, connect_timeout=0.2, read_timeout=600)
    assert asyncio.get_running_loop().time() - began < 3
    assert states(backend, fake)[A] == (False, "GET /health: NoAnswerInTime")


async def test_the_check_loop_takes_a_replica_out_and_back(opened: list[Any]) -> None:
    up = {"ok": True}

    def handler(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if up["ok"] else 503)

    backend, fake = await start(opened, handler, A, health_interval=0.05)
    up["ok"] = False
    for _ in range(100):
        if not states(backend, fake)[A][0]:
            break
        await asyncio.sleep(0.02)
    assert states(backend, fake)[A] == (False, "GET /v1/models answered 503")
    up["ok"] = True
    for _ in range(100):
        if states(backend, fake)[A][0]:
            break
        await asyncio.sleep(0.02)
    assert states(backend, fake)[A][0]


async def test_failure_reasons_say_what_happened(opened: list[Any]) -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/health":
            return httpx.Response(200)
        if r.url.host == "a.test":
            raise httpx.ConnectError("reset")
        return httpx.Response(500, json={"error": {"message": "engine on fire"}})

    backend, fake = await start(opened, handler, A, B, policy=PoolPolicy(max_failures=5))
    with pytest.raises(ServiceUnavailable) as info:
        await backend.prepare(request())
    assert "engine on fire" in info.value.message  # the last replica's own error, not "none"
    seen = states(backend, fake)
    assert seen[A][1] == "UpstreamDisconnected on connect"  # the lean client's name for it
    assert seen[B][1].startswith("status 500: engine on fire")


async def test_forward_posts_json(opened: list[Any]) -> None:
    got: list[httpx.Request] = []

    def handler(r: httpx.Request) -> httpx.Response:
        got.append(r)
        return httpx.Response(200, json={"ok": True})

    backend, _ = await start(opened, handler, A)
    assert await backend.forward("/generate", {"prompt": "x", "seed": 2**70}) == {"ok": True}
    sent = got[-1]
    assert sent.method == "POST" and sent.headers["content-type"] == "application/json"
    assert json.loads(sent.content) == {"prompt": "x", "seed": 2**70}


async def test_close_without_await_still_closes_the_session(opened: list[Any]) -> None:
    backend, _ = await start(opened, lambda r: httpx.Response(200), A)
    client = backend._client
    assert client is not None and client._clients.get(None) is not None
    session = client._clients[None]
    backend.close()
    for _ in range(50):
        if session.is_closed:
            break
        await asyncio.sleep(0.01)
    assert session.is_closed and backend.state.value == "unloaded"


async def test_a_cancel_that_cannot_reach_its_replica_is_dropped_quietly(
    opened: list[Any],
) -> None:
    async def hang(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/health":
            return httpx.Response(200)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    backend, fake = await start(opened, hang, A, B, connect_timeout=0.2, read_timeout=600)
    hanging, gone = backend.pool.replicas
    await fake.stop(B)
    began = asyncio.get_running_loop().time()
    await backend._cancel(hanging, "chatcmpl-1")  # no answer: given up at connect_timeout
    await backend._cancel(gone, "chatcmpl-1")  # refused
    assert asyncio.get_running_loop().time() - began < 3
