"""The gateway's HTTP/1.1 client for chat: keep-alive connections to plain-``http`` replicas,
the request written in one system call, the answer parsed by ``httptools`` (uvicorn's parser).

Why a client of its own on this hop (the one specialised HTTP client; httpx serves the rest,
``gateway/upstream_http.py``): the gateway sends every chat request upstream on its way to the
first token (the pass-through of ``gateway/passthrough.py`` to vlmserve workers, the streams of
its own sessions to any OpenAI server), within its overhead budget of 1 ms at c=1
(``benchmarks/overhead.py``), and a general client's machinery was most of that hop's cost.
Measured on the 2-core CPU: to the first body byte of a bare uvicorn app streaming 5 SSE events
(300 sequential requests, medians of 3 rounds), httpx 0.80-0.84 ms, aiohttp 0.36-0.41 ms;
against the stamping worker of ``benchmarks/hops.py`` (400 sequential streamed requests, 3
rounds, from the call to the worker having the request), aiohttp 0.24-0.35 ms and 0.40-0.58 ms
of CPU per request, this client 0.085-0.10 ms and 0.14-0.16 ms. It speaks only what those
requests need: ``Content-Length`` bodies, answers framed by length, chunks or the connection's
end, ``gzip``/``deflate`` answers decoded although ``identity`` was asked. The rest (``https``,
a proxy from the environment, health checks, embeddings, requests with a total timeout) goes
through httpx: see ``UpstreamHTTP.open``.

Errors: ``LeanConnectionError``'s subclasses (not connected, the connection broke, a malformed
answer: retryable, as ``RETRYABLE``) and ``UpstreamTimeout`` (no byte for ``read_timeout``
seconds).
"""

from __future__ import annotations

import asyncio
import collections
import re
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from vlmserve.errors import ServiceUnavailable

__all__ = [
    "LeanConnectionError",
    "LeanHTTP",
    "LeanResponse",
    "MalformedAnswer",
    "UpstreamDisconnected",
    "UpstreamTimeout",
    "UpstreamUnreachable",
]

_HIGH_WATER = 256 * 1024  # buffered answer bytes at which the socket stops being read
_SPLITS = re.compile(r"[\r\n\0]")
_UNSAFE_TARGET = re.compile(r"[^\x21-\x7e]")  # a space, a control or a non-ASCII character
_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class LeanConnectionError(ConnectionError):
    """Not connected, or the connection broke or carried a malformed answer (retryable).
    Its subclasses name what happened (the replica's failure reason in ``/admin/state``)."""


class UpstreamUnreachable(LeanConnectionError):
    """The connection could not be made (refused, unresolvable, or no answer in time)."""


class UpstreamDisconnected(LeanConnectionError):
    """The replica closed the connection before its answer ended."""


class MalformedAnswer(LeanConnectionError):
    """The answer is not HTTP/1.1 this client reads (or its body does not decompress)."""


class UpstreamTimeout(ServiceUnavailable):
    """The upstream sent nothing for ``read_timeout`` seconds."""

    status_code = 504


def _timeout(origin: str, before_answer: bool) -> UpstreamTimeout:
    what = "sent no answer" if before_answer else "sent nothing"
    return UpstreamTimeout(f"upstream {origin} {what} in time", code="upstream_timeout")


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; its answer's parts as they come."""

    def __init__(self, origin: str, read_timeout: float) -> None:
        self.origin, self.read_timeout = origin, read_timeout
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = self.busy = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.header_list: list[tuple[str, str]] = []
        self.head_in = self.complete = self.paused = self.seen_byte = self.keep_alive = False
        self.interim = self.stray = False  # a 1xx head; bytes of another answer after this one
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.decoder: Any = None  # a zlib decompressor for a gzip or deflate answer
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for, on an idle connection: not to be trusted
            self.close()
            return
        self.last, self.seen_byte = self.loop.time(), True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(MalformedAnswer(f"upstream {self.origin} sent a malformed answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_in and exc is None and self._until_close():
            self.on_message_complete()  # a body without a length ends with its connection
        if not self.complete:
            reason = f": {exc}" if exc else ""
            self._fail(
                UpstreamDisconnected(f"upstream {self.origin} closed the connection{reason}")
            )

    def _until_close(self) -> bool:
        named = {name.lower() for name, _ in self.header_list}
        return (
            not named & {"content-length", "transfer-encoding"}
            and self.status not in (204, 304)
            and self.status >= 200
        )

    # --- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # another answer on the wire after this one's end: never part of it
            self.stray, self.keep_alive = True, False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.stray:  # UTF-8, odd bytes kept (never a decode error)
            self.header_list.append(
                (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
            )

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.stray or (100 <= status < 200 and status != 101):
            if not self.stray:  # 100 Continue, 103 Early Hints: the answer follows
                self.interim = True
                self.header_list.clear()
            return
        self.status, self.head_in = status, True
        coding = next((v for n, v in self.header_list if n.lower() == "content-encoding"), "")
        coding = coding.strip().lower()
        if coding in ("gzip", "x-gzip", "deflate"):  # asked for identity, compressed anyway
            self.decoder = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)  # gzip or zlib
        elif coding not in ("", "identity"):
            self._fail(
                MalformedAnswer(
                    f"upstream {self.origin} compressed its answer ({coding}), which this client "
                    "cannot decode"
                )
            )
            self.close()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.stray:
            return
        if self.decoder is not None:
            try:
                body = self.decoder.decompress(body)
            except zlib.error as exc:
                self._fail(
                    MalformedAnswer(
                        f"upstream {self.origin} sent a body that does not decompress: {exc}"
                    )
                )
                self.close()
                return
            if not body:
                return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.stray or self.interim:
            self.interim = False
            return
        # asked now: once ``feed_data`` returns, the parser has moved on and says False
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake()

    # --- the caller's side --------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.busy, self.last = True, self.loop.time()
        if body:
            self.transport.writelines((head, body))  # one system call, the body not copied
        else:
            self.transport.write(head)

    async def head(self) -> None:
        while not self.head_in:
            await self._wait(before_answer=True)
        if self.error is not None:  # a head that is refused (a compressed answer)
            raise self.error

    async def next_body(self) -> bytes | None:
        """The answer's next body bytes; None at its end."""
        while not self.body:
            if self.complete:
                return None
            await self._wait(before_answer=False)
        data = self.body.popleft()
        self.buffered -= len(data)
        if self.paused and self.buffered <= _HIGH_WATER // 4 and self.transport is not None:
            self.paused, self.last = False, self.loop.time()  # the silence was ours
            self.transport.resume_reading()
        return data

    async def _wait(self, before_answer: bool) -> None:
        if self.error is None:
            self.waiter = self.loop.create_future()
            if self.timer is None:
                self.timer = self.loop.call_at(self.last + self.read_timeout, self._check_silence)
            try:
                await self.waiter
            finally:
                self.waiter = None
        if isinstance(self.error, TimeoutError):  # silence: the connection is given up
            self.close()
            raise _timeout(self.origin, before_answer) from None
        if self.error is not None:
            raise self.error

    def _check_silence(self) -> None:
        self.timer = None
        if self.waiter is None:
            return  # armed again by the next wait
        due = self.last + self.read_timeout
        if self.loop.time() >= due:
            self._fail(TimeoutError())
        else:
            self.timer = self.loop.call_at(due, self._check_silence)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def recycle(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.paused and self.transport is not None:  # an answer left unread at its end
            self.transport.resume_reading()
        self.busy = False
        self._reset()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class LeanResponse:
    """One answer (``gateway.upstream_http.UpstreamAnswer``): head in, body read as it comes."""

    __slots__ = ("_client", "_conn", "_key", "headers", "status")

    def __init__(self, client: LeanHTTP, key: tuple[str, int], conn: _Connection) -> None:
        self._client, self._key, self._conn = client, key, conn
        self.status = conn.status
        self.headers: Mapping[str, str] = CIMultiDictProxy(CIMultiDict(conn.header_list))

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def chunks(self) -> AsyncIterator[bytes]:
        while (data := await self._conn.next_body()) is not None:
            yield data

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def close(self) -> None:
        """Keep the connection for the next request if the answer was read to its end."""
        conn = self._conn
        if conn.reusable():
            conn.recycle()
            self._client.idle.setdefault(self._key, []).append(conn)
        else:
            conn.close()


class LeanHTTP:
    """Keep-alive connections per replica (``host``, ``port``), opened as needed, no limit:
    the replica pool's admission bounds how many requests are in flight."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.headers = {name.lower(): value for name, value in (headers or {}).items()}
        self.idle: dict[tuple[str, int], list[_Connection]] = {}

    async def open(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> LeanResponse:
        """Send a request to an ``http://`` URL; the answer's status and headers are in."""
        parts = urlsplit(url)
        key = (parts.hostname or "", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        merged = dict(self.headers)  # the session's own, names already in lower case
        merged.update((name.lower(), value) for name, value in (headers or {}).items())
        merged["accept-encoding"] = "identity"  # bodies pass as they come: never compressed
        host = parts.netloc.rpartition("@")[2]  # never a user's credentials in Host
        request = _request(method, target, host, merged, content)  # (head, body)
        conn = self._idle_connection(key)
        if conn is not None:
            try:
                return await self._exchange(key, conn, request)
            except LeanConnectionError:
                if conn.seen_byte:
                    raise
                # closed by the replica while idle (its keep-alive timeout): a new connection.
                # (A replica that read the request and then closed without a byte gets it
                # twice, as another replica would from ``_first_success``.)
        return await self._exchange(key, await self._connect(key, url), request)

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], url: str) -> _Connection:
        origin = f"http://{key[0]}:{key[1]}"
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin, self.read_timeout), *key),
                self.connect_timeout,
            )
        except (TimeoutError, asyncio.TimeoutError) as exc:  # two classes before 3.11
            raise UpstreamUnreachable(
                f"connecting to {url} timed out after {self.connect_timeout} s"
            ) from exc
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {url}: {exc}") from exc
        return conn

    async def _exchange(
        self, key: tuple[str, int], conn: _Connection, request: tuple[bytes, bytes]
    ) -> LeanResponse:
        try:
            conn.send(*request)
            await conn.head()
        except BaseException:
            conn.close()
            raise
        return LeanResponse(self, key, conn)

    async def aclose(self) -> None:
        idle, self.idle = self.idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _request(
    method: str, target: str, host: str, headers: Mapping[str, str], content: bytes | None
) -> tuple[bytes, bytes]:
    """The request's head (its line, ``Host``, the headers with their names in lower case,
    ``Content-Length``) and its body. A target with a space or a control character is
    percent-encoded; a header with CR, LF or NUL (one that could split the request) raises."""
    if _UNSAFE_TARGET.search(target):
        target = quote(target, safe=_TARGET_SAFE)
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    for name, value in headers.items():
        if name in _FRAMING:
            continue
        if _SPLITS.search(value) or _SPLITS.search(name) or ":" in name:
            raise ValueError(f"header {name!r} has a character HTTP does not allow")
        lines.append(f"{name}: {value}")
    body = content or b""
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1"), body
