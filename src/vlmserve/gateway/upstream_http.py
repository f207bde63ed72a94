"""The HTTP client of the proxy backends: aiohttp, one session per backend.

Why not httpx (which the rest of vlmserve uses for its own client tools): the gateway opens one
upstream stream per proxied request, and that call is on every request's time to first token.
Measured on the 2-core CPU against a bare uvicorn app streaming 5 SSE events (300 sequential
requests, medians of 3 rounds, time to the first body byte): httpx 0.80-0.84 ms, httpx over an
aiohttp transport 0.63-0.71 ms, aiohttp 0.36-0.41 ms. A ``py-spy`` profile of the gateway put
44% of its request handling inside ``httpx.AsyncClient.send`` (httpcore's anyio layer).

Chat requests to plain-``http`` upstreams without a proxy (the pass-through's, and the streams
of the gateway's own sessions) go through ``gateway/upstream_lean.py`` instead
(``open(..., lean=True)``): the same errors, a fraction of aiohttp's cost per request
(measured there).

Errors come out as two kinds: ``RETRYABLE`` (the replica could not be reached or broke the
connection: another replica may serve the request) and ``UpstreamTimeout`` (no byte for
``read_timeout`` seconds: not retried, the request may be running there).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from vlmserve.gateway.upstream_lean import LeanConnectionError, LeanHTTP, UpstreamTimeout

__all__ = [
    "RETRYABLE",
    "UpstreamAnswer",
    "UpstreamHTTP",
    "UpstreamResponse",
    "UpstreamTimeout",
    "environment_proxy",
]


# Connection refused or reset, the server gone mid-body, a body cut short or malformed.
# (aiohttp's read timeout is a ClientConnectionError too: ``_timeout`` tells them apart.)
RETRYABLE: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientResponseError,  # a malformed status line or header
    LeanConnectionError,
)


class UpstreamAnswer(Protocol):
    """An upstream answer whose head is in: ``UpstreamResponse`` or ``LeanResponse``."""

    status: int
    headers: Mapping[str, str]

    @property
    def is_success(self) -> bool: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


@dataclass(slots=True, eq=False)
class UpstreamResponse:
    """One upstream answer whose body is read as it comes (``chunks``) or whole (``read``)."""

    status: int
    headers: Mapping[str, str]
    _response: aiohttp.ClientResponse

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (decoded if the upstream compressed them)."""
        try:
            async for data in self._response.content.iter_any():
                yield data
        except aiohttp.SocketTimeoutError as exc:
            raise _timeout(self._response) from exc

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except aiohttp.SocketTimeoutError as exc:
            raise _timeout(self._response) from exc

    def close(self) -> None:
        """Drop the connection if the body was not read to its end, else keep it for reuse."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


def _timeout(response: aiohttp.ClientResponse) -> UpstreamTimeout:
    return UpstreamTimeout(f"upstream {response.url.origin()} sent nothing in time",
                           code="upstream_timeout")  # fmt: skip


class UpstreamHTTP:
    """One aiohttp session for a backend's replicas (opened in the running loop on first use).

    ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` apply as with httpx, read once per replica
    origin (aiohttp's own ``trust_env`` reads them and ``~/.netrc`` on a worker thread for
    every request: a thread hop on each proxied request's first token). No limit on
    connections: the replica pool's admission bounds how many requests are in flight."""

    def __init__(self, *, connect_timeout: float, read_timeout: float,
                 headers: Mapping[str, str] | None = None):  # fmt: skip
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._lean: LeanHTTP | None = None
        self._proxies: dict[str, str | None] = {}  # origin -> its proxy from the environment

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=timeout,
                headers=self.headers,
            )
        return self._session

    async def open(self, method: str, url: str, *, content: bytes | None = None,
                   headers: Mapping[str, str] | None = None, timeout: float | None = None,
                   lean: bool = False) -> UpstreamAnswer:  # fmt: skip
        """Send a request; the answer's status and headers are in, its body not yet read.
        ``lean``: through ``LeanHTTP`` where it can go (``http``, no proxy, no own timeout)."""
        if lean and timeout is None and _lean_can(url) and self._proxy(url) is None:
            if self._lean is None:
                self._lean = LeanHTTP(connect_timeout=self.connect_timeout,
                                      read_timeout=self.read_timeout,
                                      headers=self.headers)  # fmt: skip
            return await self._lean.open(method, url, content=content, headers=headers)
        kw: dict[str, Any] = {"data": content, "headers": headers, "allow_redirects": False,
                              "proxy": self._proxy(url)}  # fmt: skip
        if timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
        try:
            response = await self._client().request(method, url, **kw)
        except aiohttp.ConnectionTimeoutError:
            raise  # not connected: retryable
        except aiohttp.SocketTimeoutError as exc:  # connected, sent, no answer: not retried
            raise UpstreamTimeout(f"upstream {url} sent no answer in time",
                                  code="upstream_timeout") from exc  # fmt: skip
        except asyncio.TimeoutError as exc:  # a short request's own total ``timeout``
            raise aiohttp.ServerTimeoutError(f"{method} {url}: no answer in {timeout} s") from exc
        return UpstreamResponse(response.status, response.headers, response)

    def _proxy(self, url: str) -> str | None:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        if origin not in self._proxies:
            self._proxies[origin] = environment_proxy(parts.scheme, parts.hostname or "")
        return self._proxies[origin]

    async def request(self, method: str, url: str, *, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeout: float | None = None) -> tuple[int, bytes]:  # fmt: skip
        """Send a request and read its whole answer: ``(status, body)``."""
        response = await self.open(method, url, content=content, headers=headers, timeout=timeout)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def aclose(self) -> None:
        if self._lean is not None:
            lean, self._lean = self._lean, None
            await lean.aclose()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _lean_can(url: str) -> bool:
    """Plain ``http`` without credentials in the URL (aiohttp turns those into Basic auth)."""
    return url.startswith("http://") and "@" not in url[7:].partition("/")[0]


def environment_proxy(scheme: str, host: str) -> str | None:
    """The proxy the environment names for ``scheme://host`` (None: direct, or ``NO_PROXY``)."""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    if proxy is None or urllib.request.proxy_bypass_environment(host):
        return None
    return proxy
