"""Upstreams on real sockets for the proxy backends' tests.

``FakeUpstreams`` serves httpx-style handlers (``handler(httpx.Request) -> httpx.Response``,
sync or async) from aiohttp servers in the test's own loop, one server per fake base URL, so a
handler can tell replicas apart by ``request.url`` as before. Failures are real socket events:
- a handler that raises an ``httpx.TransportError`` (``ConnectError``...) gets its connection
  dropped before any answer;
- a body that raises while it streams is cut off mid-body (the connection dropped after the
  bytes it sent).
``serve_asgi`` runs an ASGI app (a vlmserve worker) under uvicorn in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from aiohttp import web

from support import free_port

Handler = Callable[[httpx.Request], Any]
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}


class FakeUpstreams:
    """One aiohttp server per fake base URL, all answering through ``handler``."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.urls: dict[str, str] = {}  # fake base URL -> real one
        self._runners: dict[str, web.AppRunner] = {}

    @classmethod
    async def start(cls, handler: Handler, *names: str) -> FakeUpstreams:
        fake = cls(handler)
        for name in names:
            await fake.add(name)
        return fake

    async def add(self, name: str) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._serve(name))
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1,
        )
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self._runners[name] = runner
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def real(self, *names: str) -> list[str]:
        return [self.urls[n] for n in names]

    def fake(self, url: str) -> str:
        """The fake base URL of a real one (``url`` unchanged if it is not ours)."""
        return next((n for n, u in self.urls.items() if u == url.rstrip("/")), url)

    async def stop(self, name: str) -> None:
        """Stop one server: its port refuses connections from now on."""
        await self._runners.pop(name).cleanup()

    async def aclose(self) -> None:
        for name in list(self._runners):
            await self.stop(name)

    def _serve(self, name: str) -> Callable[[web.Request], Any]:
        async def serve(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            asked = httpx.Request(
                request.method,
                name + request.path_qs,
                headers=list(request.headers.items()),
                content=body,
            )
            try:
                answer = self.handler(asked)
                if inspect.isawaitable(answer):
                    answer = await answer
            except httpx.TransportError:
                return _drop(request)
            return await _relay(request, answer)

        return serve


async def _relay(request: web.Request, answer: httpx.Response) -> web.StreamResponse:
    headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
    response = web.StreamResponse(status=answer.status_code, headers=headers)
    await response.prepare(request)
    try:
        async for data in answer.stream:  # type: ignore[union-attr]
            await response.write(data)
            await asyncio.sleep(0)  # each piece its own write, as a streaming server
    except httpx.TransportError:
        return _drop(request)
    await response.write_eof()
    return response


def _drop(request: web.Request) -> web.StreamResponse:
    """Close the connection under the request: the client sees a reset, no answer."""
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError


@contextlib.asynccontextmanager
async def fake_upstreams(handler: Handler, *names: str) -> AsyncIterator[FakeUpstreams]:
    fake = await FakeUpstreams.start(handler, *names)
    try:
        yield fake
    finally:
        await fake.aclose()


@contextlib.asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    """uvicorn serving ``app`` (its lifespan included) on a free port in this loop."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server did not start")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
