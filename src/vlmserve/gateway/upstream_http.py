"""The HTTP client of the proxy backends: httpx, one client per backend (and per proxy).

Chat requests to plain-``http`` upstreams without a proxy (the pass-through's, and the streams
of the gateway's own sessions) go through ``gateway/upstream_lean.py`` instead
(``open(..., lean=True)``): that hop is on every proxied request's time to first token, and
httpx's cost per request would be most of the gateway's budget there (measured in its
docstring). Everything else comes here: ``https``, a proxy from the environment, health checks,
cancels, embeddings and the relayed worker endpoints, requests with a total timeout.

Errors come out in the lean client's words, whichever client sent the request: ``RETRYABLE``
(``UpstreamUnreachable``, ``UpstreamDisconnected``, ``MalformedAnswer``, ``NoAnswerInTime``:
the replica could not be reached, broke the connection or answered garbage, and another
replica may serve the request; the class name is the replica's failure reason in
``/admin/state``) and ``UpstreamTimeout`` (no byte for ``read_timeout`` seconds: not retried,
the request may be running there).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from vlmserve.gateway.upstream_lean import (
    LeanConnectionError,
    LeanHTTP,
    MalformedAnswer,
    UpstreamDisconnected,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = [
    "RETRYABLE",
    "NoAnswerInTime",
    "UpstreamAnswer",
    "UpstreamHTTP",
    "UpstreamResponse",
    "UpstreamTimeout",
    "environment_proxy",
]


class NoAnswerInTime(LeanConnectionError):
    """A request's own total ``timeout`` ran out (health checks, cancels): retryable."""


# Connection refused or reset, the server gone mid-body, a body cut short or malformed, a short
# request's own timeout: the lean client's errors, and httpx's as ``_translated`` names them.
RETRYABLE: tuple[type[BaseException], ...] = (LeanConnectionError,)

T = TypeVar("T")
_CLOSING: set[asyncio.Task[None]] = set()  # answers dropped mid-body, their connections closing


class UpstreamAnswer(Protocol):
    """An upstream answer whose head is in: ``UpstreamResponse`` or ``LeanResponse``."""

    status: int
    headers: Mapping[str, str]

    @property
    def is_success(self) -> bool: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


@contextlib.contextmanager
def _translated(url: httpx.URL | str, before_answer: bool) -> Iterator[None]:
    """httpx's transport errors as the lean client's (see the module docstring)."""
    try:
        yield
    except httpx.ReadTimeout as exc:
        what = "sent no answer" if before_answer else "sent nothing"
        origin = url if before_answer else _origin(url)
        raise UpstreamTimeout(f"upstream {origin} {what} in time", code="upstream_timeout") from exc
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.PoolTimeout) as exc:
        how = "timed out" if isinstance(exc, httpx.TimeoutException) else f"failed: {exc}"
        raise UpstreamUnreachable(f"connecting to {url} {how}") from exc
    except httpx.DecodingError as exc:
        raise MalformedAnswer(f"the answer of {url} does not decode: {exc}") from exc
    except httpx.RemoteProtocolError as exc:
        if "disconnect" in str(exc) or "incomplete" in str(exc).lower():
            raise UpstreamDisconnected(f"{url}: {exc}") from exc
        raise MalformedAnswer(f"{url}: {exc}") from exc
    except (httpx.ReadError, httpx.WriteError, httpx.CloseError, httpx.WriteTimeout) as exc:
        raise UpstreamDisconnected(f"{url}: {type(exc).__name__} {exc}") from exc


def _origin(url: httpx.URL | str) -> str:
    parts = httpx.URL(url)
    return f"{parts.scheme}://{parts.netloc.decode('ascii')}"


@dataclass(slots=True, eq=False)
class UpstreamResponse:
    """One upstream answer whose body is read as it comes (``chunks``) or whole (``read``)."""

    status: int
    headers: Mapping[str, str]
    _response: httpx.Response

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (decoded if the upstream compressed them)."""
        with _translated(self._response.url, before_answer=False):
            async for data in self._response.aiter_bytes():
                yield data

    async def read(self) -> bytes:
        with _translated(self._response.url, before_answer=False):
            return await self._response.aread()

    def close(self) -> None:
        """Drop the connection if the body was not read to its end (a body read to its end
        gave its connection back to the pool already)."""
        if self._response.is_closed:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the process is ending
            task = asyncio.get_running_loop().create_task(self._response.aclose())
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)


class UpstreamHTTP:
    """A backend's httpx clients for its replicas: one for direct requests, one per proxy.

    ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/``NO_PROXY`` are read once per replica origin
    (``environment_proxy``), so a request's proxy is decided without reading the environment on
    its way. No limit on connections: the replica pool's admission bounds how many requests
    are in flight. Redirects are answered, not followed (the entry's key stays with it)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        headers: Mapping[str, str] | None = None,
    ):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.headers = dict(headers or {})
        self._clients: dict[str | None, httpx.AsyncClient] = {}  # proxy (None: direct) -> client
        self._lean: LeanHTTP | None = None
        self._proxies: dict[str, str | None] = {}  # origin -> its proxy from the environment

    def _client(self, proxy: str | None) -> httpx.AsyncClient:
        client = self._clients.get(proxy)
        if client is None or client.is_closed:
            client = self._clients[proxy] = httpx.AsyncClient(
                headers=self.headers,
                timeout=httpx.Timeout(None, connect=self.connect_timeout, read=self.read_timeout),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                proxy=proxy,
                trust_env=False,  # the proxy is ``environment_proxy``'s, read once per origin
                follow_redirects=False,
            )
        return client

    async def open(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        lean: bool = False,
    ) -> UpstreamAnswer:
        """Send a request; the answer's status and headers are in, its body not yet read.
        ``lean``: through ``LeanHTTP`` where it can go (``http``, no proxy, no own timeout)."""
        proxy = self._proxy(url)
        if lean and timeout is None and _lean_can(url) and proxy is None:
            if self._lean is None:
                self._lean = LeanHTTP(
                    connect_timeout=self.connect_timeout,
                    read_timeout=self.read_timeout,
                    headers=self.headers,
                )
            return await self._lean.open(method, url, content=content, headers=headers)
        client = self._client(proxy)
        own = httpx.USE_CLIENT_DEFAULT if timeout is None else httpx.Timeout(None)  # the total
        request = client.build_request(method, url, content=content, headers=headers, timeout=own)
        with _translated(url, before_answer=True):
            response = await _within(client.send(request, stream=True), timeout, method, url)
        return UpstreamResponse(response.status_code, response.headers, response)

    def _proxy(self, url: str) -> str | None:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        if origin not in self._proxies:
            self._proxies[origin] = environment_proxy(parts.scheme, parts.hostname or "")
        return self._proxies[origin]

    async def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes]:
        """Send a request and read its whole answer: ``(status, body)``; ``timeout`` bounds
        both (a total, as a health check or a cancel needs)."""
        whole = self._whole(method, url, content, headers, timeout)
        return await _within(whole, timeout, method, url)

    async def _whole(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> tuple[int, bytes]:
        response = await self.open(method, url, content=content, headers=headers, timeout=timeout)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def aclose(self) -> None:
        if self._lean is not None:
            lean, self._lean = self._lean, None
            await lean.aclose()
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()


async def _within(answer: Awaitable[T], timeout: float | None, method: str, url: str) -> T:
    """``answer`` within a request's own total ``timeout`` (None: the client's connect and
    read timeouts only)."""
    if timeout is None:
        return await answer
    try:
        return await asyncio.wait_for(answer, timeout)
    except asyncio.TimeoutError as exc:
        raise NoAnswerInTime(f"{method} {url}: no answer in {timeout} s") from exc


def _lean_can(url: str) -> bool:
    """Plain ``http`` without credentials in the URL (httpx turns those into Basic auth)."""
    return url.startswith("http://") and "@" not in url[7:].partition("/")[0]


def environment_proxy(scheme: str, host: str) -> str | None:
    """The proxy the environment names for ``scheme://host`` (None: direct, or ``NO_PROXY``)."""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    if proxy is None or urllib.request.proxy_bypass_environment(host):  # type: ignore[attr-defined]
        return None
    return proxy
