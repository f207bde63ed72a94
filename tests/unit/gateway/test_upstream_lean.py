"""The pass-through's lean HTTP client against a scripted server on a real socket: what it
writes, how it reads each kind of body, keep-alive, timeouts and broken connections."""

from __future__ import annotations

import asyncio
import gzip
import re
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from vlmserve.gateway.upstream_http import RETRYABLE, UpstreamHTTP, UpstreamTimeout
from vlmserve.gateway.upstream_lean import (
    LeanHTTP,
    MalformedAnswer,
    UpstreamDisconnected,
    UpstreamUnreachable,
)

pytestmark = pytest.mark.timeout(30)

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # -> keep the connection
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@dataclass
class Scripted:
    """A server that hands each request's bytes to ``answer``; counts its connections."""

    answer: Answer
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.answer(request, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Answer], Awaitable[Scripted]]]:
    made: list[Scripted] = []

    async def start(answer: Answer) -> Scripted:
        server = Scripted(answer)
        server.server = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        made.append(server)
        return server

    yield start
    for server in made:
        assert server.server is not None
        server.server.close()


def lean(read_timeout: float = 2.0, **headers: str) -> LeanHTTP:
    return LeanHTTP(connect_timeout=1, read_timeout=read_timeout, headers=headers)


async def ok(request: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(OK)
    return True


async def test_the_request_carries_host_length_and_merged_headers(scripted) -> None:
    server = await scripted(ok)
    http = lean(Authorization="Bearer entry")
    response = await http.open(
        "POST",
        server.url + "/v1/x?a=b%3Ac",
        content=b'{"k":1}',
        headers={"content-type": "application/json", "AUTHORIZATION": "Bearer given"},
    )
    assert (response.status, await response.read()) == (200, b"ok")
    response.close()
    await http.aclose()
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/x?a=b%3Ac HTTP/1.1"  # the query as given
    assert f"host: {server.url.removeprefix('http://')}" in lines
    assert "content-length: 7" in lines and body == b'{"k":1}'
    assert [line for line in lines if line.startswith("authorization")] == [
        "authorization: Bearer given"
    ]  # one, the caller's


@pytest.mark.parametrize(
    "header", [{"x-evil": "a\r\nhost: elsewhere"}, {"x-a:b": "1"}, {"x-nul": "a\0b"}]
)
async def test_a_header_that_would_split_or_bend_the_request_is_refused(
    scripted, header: dict[str, str]
) -> None:
    server = await scripted(ok)
    with pytest.raises(ValueError, match=re.escape(repr(next(iter(header))))):
        await lean().open("GET", server.url + "/", headers=header)
    assert server.requests == []


async def test_a_connection_is_kept_and_reused_once_its_answer_was_read(scripted) -> None:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if request.startswith(b"GET /unfinished"):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n")
            return True
        return await ok(request, writer)

    server = await scripted(answer)
    http = lean()
    for _ in range(3):
        response = await http.open("GET", server.url + "/")
        await response.read()
        response.close()
    unread = await http.open("GET", server.url + "/unfinished")
    unread.close()  # dropped: its answer had not ended
    again = await http.open("GET", server.url + "/")
    await again.read()
    again.close()
    await http.aclose()
    assert (len(server.requests), server.connections) == (5, 2)


async def test_a_connection_the_replica_closed_while_idle_is_replaced(scripted) -> None:
    async def once(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK)  # says keep-alive (HTTP/1.1), then closes: its idle timeout
        return False

    server = await scripted(once)
    http = lean()
    for _ in range(2):
        response = await http.open("GET", server.url + "/")
        assert await response.read() == b"ok"
        response.close()
        await asyncio.sleep(0.05)  # the close reaches the client while the connection idles
    await http.aclose()
    assert server.connections == 2


@pytest.mark.parametrize("framing", ["chunked", "length", "until-close"])
async def test_each_body_framing_comes_whole_and_in_pieces(scripted, framing: str) -> None:
    parts = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    async def stream(request: bytes, writer: asyncio.StreamWriter) -> bool:
        head = {
            "chunked": b"transfer-encoding: chunked\r\n",
            "until-close": b"",
            "length": b"content-length: %d\r\n" % sum(map(len, parts)),
        }[framing]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + head + b"\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if framing == "chunked" else part)
            await writer.drain()
            await asyncio.sleep(0.02)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        return framing != "until-close"

    server = await scripted(stream)
    response = await lean().open("POST", server.url + "/s", content=b"{}")
    assert response.headers["Content-Type"] == "text/event-stream"  # any case
    got = [data async for data in response.chunks()]
    assert b"".join(got) == b"".join(parts) and len(got) >= 2  # as they came
    response.close()


async def test_silence_before_the_answer_is_a_504_naming_the_upstream(scripted) -> None:
    async def never(request: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(3600)
        return False

    server = await scripted(never)
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamTimeout) as info:
        await lean(read_timeout=0.2).open("POST", server.url + "/v1/chat/completions")
    assert 0.15 < asyncio.get_running_loop().time() - started < 2
    assert info.value.status_code == 504 and info.value.code == "upstream_timeout"
    assert server.url in info.value.message and "no answer" in info.value.message


async def test_silence_mid_body_is_a_504_but_a_slow_steady_body_is_not(scripted) -> None:
    async def slow_then_stall(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # one byte every 0.1 s: 0.6 s in all, each gap under the timeout
            writer.write(b"1\r\nx\r\n")
            await asyncio.sleep(0.1)
        await asyncio.sleep(3600)
        return False

    server = await scripted(slow_then_stall)
    response = await lean(read_timeout=0.3).open("GET", server.url + "/")
    got = b""
    with pytest.raises(UpstreamTimeout) as info:
        async for data in response.chunks():
            got += data
    assert got == b"x" * 6 and "sent nothing in time" in info.value.message
    response.close()


async def test_a_body_cut_short_is_retryable_after_the_bytes_that_came(scripted) -> None:
    async def cut(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\ndata: 1\n\n")
        await writer.drain()
        writer.transport.abort()
        return False

    server = await scripted(cut)
    response = await lean().open("GET", server.url + "/")
    got = b""
    with pytest.raises(RETRYABLE) as info:
        async for data in response.chunks():
            got += data
    assert got == b"data: 1\n\n" and "closed the connection" in str(info.value)
    assert isinstance(info.value, UpstreamDisconnected)


async def test_a_malformed_answer_or_a_refused_connect_is_retryable(scripted) -> None:
    async def garbage(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SPDY/9 banana\r\n\r\n")
        return True

    server = await scripted(garbage)
    with pytest.raises(MalformedAnswer, match="malformed"):
        await lean().open("GET", server.url + "/")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(UpstreamUnreachable, match="cannot connect"):
        await lean().open("GET", f"http://127.0.0.1:{port}/")


async def test_an_unread_large_answer_stops_the_socket_until_it_is_read(scripted) -> None:
    size = 4 * 1024 * 1024

    async def big(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        return True

    server = await scripted(big)
    response = await lean().open("GET", server.url + "/")
    await asyncio.sleep(0.3)
    conn = response._conn
    assert conn.paused and conn.buffered < size  # not all of it held in memory
    assert len(await response.read()) == size and not conn.paused


async def test_upstream_http_goes_lean_only_where_it_can(
    scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await scripted(ok)
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    http = UpstreamHTTP(connect_timeout=1, read_timeout=1)
    response = await http.open("GET", server.url + "/", lean=True)
    assert type(response).__name__ == "LeanResponse" and await response.read() == b"ok"
    response.close()
    plain = await http.open("GET", server.url + "/")  # not asked: httpx
    assert type(plain).__name__ == "UpstreamResponse"
    plain.close()
    timed = await http.open("GET", server.url + "/", lean=True, timeout=1)  # its own timeout
    assert type(timed).__name__ == "UpstreamResponse"
    timed.close()
    with_user = server.url.replace("http://", "http://user:pw@")  # httpx's Basic auth
    basic = await http.open("GET", with_user + "/", lean=True)
    assert type(basic).__name__ == "UpstreamResponse"
    basic.close()
    await http.aclose()
    assert http._lean is None


async def test_a_proxy_from_the_environment_still_applies_to_lean_requests(
    scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await scripted(ok)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    http = UpstreamHTTP(connect_timeout=1, read_timeout=1)
    response = await http.open("GET", "http://replica.test:8000/health", lean=True)
    assert await response.read() == b"ok"
    response.close()
    await http.aclose()
    assert proxy.requests[0].startswith(b"GET http://replica.test:8000/health HTTP/1.1")


async def test_bytes_on_an_idle_connection_retire_it(scripted) -> None:
    async def chatty(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")  # asked by nobody
        return True

    server = await scripted(chatty)
    http = lean()
    bodies = []
    for _ in range(2):
        response = await http.open("GET", server.url + "/")
        bodies.append(await response.read())
        response.close()
        await asyncio.sleep(0.1)
    await http.aclose()
    assert bodies == [b"ok", b"ok"] and server.connections == 2  # never the stale answer


async def test_a_target_with_a_space_or_a_control_character_goes_percent_encoded(
    scripted,
) -> None:
    server = await scripted(ok)
    response = await lean().open("GET", server.url + "/v1/streams/a b\x7f?x=1")
    await response.read()
    response.close()
    assert server.requests[0].startswith(b"GET /v1/streams/a%20b%7F?x=1 HTTP/1.1\r\n")


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_it_asks_for_identity_and_decodes_an_answer_compressed_anyway(
    scripted, coding: str
) -> None:
    parts = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    packed = gzip.compress(b"".join(parts)) if coding == "gzip" else zlib.compress(b"".join(parts))

    async def compressed(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-encoding: %s\r\n"
            b"transfer-encoding: chunked\r\n\r\n" % coding.encode()
        )
        for i in range(0, len(packed), 7):  # in pieces, as a proxy would flush them
            writer.write(b"%x\r\n%s\r\n" % (len(packed[i : i + 7]), packed[i : i + 7]))
        writer.write(b"0\r\n\r\n")
        return True

    server = await scripted(compressed)
    response = await lean().open(
        "POST",
        server.url + "/v1/chat/completions",
        content=b"{}",
        headers={"Accept-Encoding": "gzip"},
    )
    assert await response.read() == b"".join(parts)
    assert b"\r\naccept-encoding: identity\r\n" in server.requests[0]


async def test_an_encoding_it_cannot_decode_is_refused_at_the_head(scripted) -> None:
    async def brotli(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 1\r\n\r\nx")
        return True

    server = await scripted(brotli)
    with pytest.raises(RETRYABLE, match=r"compressed its answer \(br\)"):
        await lean().open("GET", server.url + "/")


async def test_the_request_line_host_and_length_of_a_plain_get_and_post(scripted) -> None:
    server = await scripted(ok)
    http = lean(Authorization="Bearer entry")
    for method, url in (
        ("GET", "http://user:secret@" + server.url.removeprefix("http://")),
        ("POST", server.url + "/v1/x"),
    ):
        response = await http.open(method, url, headers={"host": "evil", "x-after": "1"})
        await response.read()
        response.close()
    await http.aclose()
    get, post = (r.decode().split("\r\n") for r in server.requests)
    host = "host: " + server.url.removeprefix("http://")
    assert get[0] == "GET / HTTP/1.1" and host in get and "secret" not in "".join(get)
    assert "authorization: Bearer entry" in get  # the session's own header
    assert "x-after: 1" in get and "host: evil" not in get  # a caller's Host is dropped
    assert not any(line.startswith("content-length") for line in get)  # no body, no length
    assert post[0] == "POST /v1/x HTTP/1.1" and "content-length: 0" in post


async def test_a_chunked_body_ended_by_a_clean_close_is_cut_short_not_complete(scripted) -> None:
    async def cut(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        return False  # closed cleanly, without the last chunk

    server = await scripted(cut)
    response = await lean().open("GET", server.url + "/")
    with pytest.raises(UpstreamDisconnected):
        await response.read()


async def test_a_connect_that_hangs_gives_up_after_connect_timeout() -> None:
    with socket.socket() as full:  # a listener whose accept queue is full: SYNs are dropped
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = [socket.socket() for _ in range(3)]
        for s in queued:
            s.setblocking(False)
            s.connect_ex(full.getsockname())
        http = LeanHTTP(connect_timeout=0.2, read_timeout=30)
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(UpstreamUnreachable, match=r"timed out after 0\.2 s"):
                await http.open("GET", f"http://127.0.0.1:{full.getsockname()[1]}/health")
        finally:
            for s in queued:
                s.close()
    assert 0.15 < asyncio.get_running_loop().time() - started < 5


async def test_an_answer_left_unread_while_reading_was_paused_leaves_a_working_connection(
    scripted,
) -> None:
    size = 300 * 1024  # over the high-water mark: reading pauses with the answer all in

    async def big_then_small(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if request.startswith(b"GET /big"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"x" * size)
        else:
            writer.write(OK)
        return True

    server = await scripted(big_then_small)
    http = lean(read_timeout=2)
    response = await http.open("GET", server.url + "/big")
    await asyncio.sleep(0.2)
    assert response._conn.paused and response._conn.complete  # the case in question
    await anext(response.chunks())
    response.close()  # read in part, but whole: pooled
    again = await http.open("GET", server.url + "/small")
    assert await again.read() == b"ok" and server.connections == 1  # the same, reading again
    again.close()


async def test_an_informational_head_is_skipped_and_stray_bytes_never_join_an_answer(
    scripted,
) -> None:
    async def hints_then_stray(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if request.startswith(b"GET /first"):
            writer.write(
                b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst"
                b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nst"
            )
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond")
        return True

    server = await scripted(hints_then_stray)
    http = lean()
    first = await http.open("GET", server.url + "/first")
    assert first.status == 200 and "link" not in first.headers
    assert await first.read() == b"first"
    first.close()  # stray bytes followed it: the connection is not kept
    second = await http.open("GET", server.url + "/second")
    assert await second.read() == b"second" and server.connections == 2
    second.close()
