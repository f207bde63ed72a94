"""The proxy backends' HTTP client on real sockets: timeouts, proxies, redirects, connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from upstreams import FakeUpstreams, fake_upstreams
from vlmserve.gateway.upstream_http import (
    RETRYABLE,
    UpstreamHTTP,
    UpstreamTimeout,
    environment_proxy,
)
from vlmserve.gateway.upstream_lean import UpstreamUnreachable

pytestmark = pytest.mark.timeout(60)
A = "http://a.test"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    yield


@pytest.fixture
async def client() -> AsyncIterator[UpstreamHTTP]:
    http = UpstreamHTTP(connect_timeout=0.5, read_timeout=0.5, headers={"Authorization": "k"})
    yield http
    await http.aclose()


class Stall(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"head"
        await asyncio.sleep(3600)


def echo(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "method": request.method,
            "path": request.url.path,
            "body": request.content.decode(),
            "headers": dict(request.headers),
        },
    )


async def test_request_sends_body_and_headers_and_keeps_the_sessions_own() -> None:
    http = UpstreamHTTP(connect_timeout=1, read_timeout=1, headers={"Authorization": "Bearer k"})
    async with fake_upstreams(echo, A) as fake:
        status, body = await http.request(
            "POST", fake.urls[A] + "/x", content=b'{"a": 1}', headers={"X-Extra": "1"}, timeout=1
        )
        response = await http.open("GET", fake.urls[A] + "/y")
        assert response.headers["content-type"] == "application/json"
        response.close()
    await http.aclose()
    seen = httpx.Response(status, content=body).json()
    assert (status, seen["method"], seen["path"], seen["body"]) == (200, "POST", "/x", '{"a": 1}')
    assert seen["headers"]["x-extra"] == "1" and seen["headers"]["authorization"] == "Bearer k"


async def test_a_redirect_is_answered_not_followed(client: UpstreamHTTP) -> None:
    def moved(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/elsewhere":
            return httpx.Response(200, text="followed")
        return httpx.Response(307, headers={"location": "/elsewhere"})

    async with fake_upstreams(moved, A) as fake:
        status, _ = await client.request("POST", fake.urls[A] + "/v1/chat/completions")
    assert status == 307  # an upstream never sends the gateway (and its key) elsewhere


async def test_silence_before_the_answer_is_a_504_naming_the_upstream(client: UpstreamHTTP) -> None:
    async def never(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async with fake_upstreams(never, A) as fake:
        with pytest.raises(UpstreamTimeout) as info:
            await client.open("POST", fake.urls[A] + "/v1/chat/completions")
    assert info.value.status_code == 504 and info.value.code == "upstream_timeout"
    assert fake.urls[A] in info.value.message


@pytest.mark.parametrize("how", ["chunks", "read"])
async def test_silence_mid_body_is_a_504(client: UpstreamHTTP, how: str) -> None:
    async with fake_upstreams(lambda r: httpx.Response(200, stream=Stall()), A) as fake:
        response = await client.open("GET", fake.urls[A] + "/")
        with pytest.raises(UpstreamTimeout) as info:
            if how == "read":
                await response.read()
            else:
                async for _ in response.chunks():
                    pass
        response.close()
    assert info.value.code == "upstream_timeout" and "127.0.0.1" in info.value.message


async def test_a_short_requests_own_timeout_is_a_retryable_error(client: UpstreamHTTP) -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async with fake_upstreams(slow, A) as fake:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RETRYABLE) as info:
            await client.request("GET", fake.urls[A] + "/health", timeout=0.1)
    assert asyncio.get_running_loop().time() - started < 0.45  # its own, not read_timeout
    assert "/health: no answer in 0.1 s" in str(info.value)


async def test_a_connect_that_hangs_is_retryable_after_connect_timeout() -> None:
    with socket.socket() as full:  # a listener whose accept queue is full: SYNs are dropped
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        url = f"http://127.0.0.1:{full.getsockname()[1]}"
        queued = [socket.socket() for _ in range(3)]
        for s in queued:
            s.setblocking(False)
            s.connect_ex(full.getsockname())  # the first ones fill the queue
        http = UpstreamHTTP(connect_timeout=0.2, read_timeout=30)
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(RETRYABLE) as info:
                await http.request("GET", url + "/health")
        finally:
            await http.aclose()
            for s in queued:
                s.close()
    assert isinstance(info.value, UpstreamUnreachable) and "timed out" in str(info.value)  # hung
    assert 0.15 < asyncio.get_running_loop().time() - started < 5


async def test_more_streams_at_once_than_the_clients_default_pool() -> None:
    gate = asyncio.Event()

    class Held(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await gate.wait()

    long_client = UpstreamHTTP(connect_timeout=2, read_timeout=30)
    async with fake_upstreams(lambda r: httpx.Response(200, stream=Held()), A) as fake:
        opened = await asyncio.wait_for(
            asyncio.gather(*(long_client.open("POST", fake.urls[A] + "/s") for _ in range(110))), 20
        )
        assert len(opened) == 110  # the pool's admission is the limit, not the client's
        gate.set()
        for response in opened:
            response.close()
    await long_client.aclose()


async def test_aclose_closes_the_session_and_a_later_call_opens_another() -> None:
    http = UpstreamHTTP(connect_timeout=1, read_timeout=1)
    async with fake_upstreams(echo, A) as fake:
        await http.request("GET", fake.urls[A] + "/1")
        first = http._clients[None]
        await http.aclose()
        assert first.is_closed and http._clients == {}
        assert (await http.request("GET", fake.urls[A] + "/2"))[0] == 200
        assert http._clients[None] is not first
    await http.aclose()


def test_environment_proxy_follows_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert environment_proxy("http", "10.0.0.5") is None
    monkeypatch.setenv("ALL_PROXY", "http://all:1")
    assert environment_proxy("http", "10.0.0.5") == "http://all:1"
    monkeypatch.setenv("HTTP_PROXY", "http://p:3128")
    assert environment_proxy("http", "10.0.0.5") == "http://p:3128"
    assert environment_proxy("https", "10.0.0.5") == "http://all:1"
    monkeypatch.setenv("NO_PROXY", "10.0.0.5,.internal")
    assert environment_proxy("http", "10.0.0.5") is None
    assert environment_proxy("http", "gpu1.internal") is None
    assert environment_proxy("http", "10.0.0.6") == "http://p:3128"


async def test_requests_go_through_the_environments_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def proxy(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text="via proxy")

    fake = await FakeUpstreams.start(proxy, "http://proxy")
    try:
        monkeypatch.setenv("HTTP_PROXY", fake.urls["http://proxy"])
        monkeypatch.setenv("NO_PROXY", "direct.test")
        http = UpstreamHTTP(connect_timeout=1, read_timeout=1)
        status, body = await http.request("GET", "http://replica.test:8000/health")
        with pytest.raises(RETRYABLE):  # bypassed: direct, and nothing resolves it
            await http.request("GET", "http://direct.test/health", timeout=2)
        monkeypatch.delenv("HTTP_PROXY")  # read once per origin: still the proxy
        again = await http.request("GET", "http://replica.test:8000/v1/models")
        await http.aclose()
    finally:
        await fake.aclose()
    assert (status, body, again[0]) == (200, b"via proxy", 200)
    assert len(seen) == 2  # "direct.test" never reached the proxy
