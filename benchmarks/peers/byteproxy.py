"""The least a Python proxy can do: forward each request's bytes to one upstream, and the
answer's bytes back as they come (no parsing, no sessions, no middleware).

    BYTEPROXY_UPSTREAM=http://127.0.0.1:8000 python -m uvicorn byteproxy:app \
        --app-dir benchmarks/peers --http httptools --port 8001

``benchmarks/overhead.py`` runs it as the ``byteproxy`` setup: the time it adds is the floor
under what vlmserve's gateway adds on the same machine (uvicorn + aiohttp, one extra hop).
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"host"}
_session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _session
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if _session is None:
        _session = aiohttp.ClientSession(auto_decompress=False)
    headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in _HOP]
    url = os.environ["BYTEPROXY_UPSTREAM"] + scope["path"]
    async with _session.request(scope["method"], url, data=body, headers=headers) as upstream:
        out = [
            (k.lower().encode(), v.encode())
            for k, v in upstream.headers.items()
            if k.lower().encode() not in _HOP
        ]
        await send({"type": "http.response.start", "status": upstream.status, "headers": out})
        async for chunk in upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if _session is not None:
                await _session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
