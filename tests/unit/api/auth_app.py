"""A tiny app behind AuthMiddleware and ways to call it with exact scopes (for the auth tests)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import httpx
from fastapi import FastAPI

from vlmserve.api.auth import AuthMiddleware

API_KEY = "sk-api-0123456789"
ADMIN_KEY = "sk-admin-9876543210"


def build(**kw: Any) -> tuple[AuthMiddleware, list[str]]:
    hits: list[str] = []
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        hits.append("models")
        return {"data": []}

    @app.get("/admin/state")
    async def state() -> dict:
        hits.append("admin")
        return {"models": []}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    async def metrics() -> str:
        return ""

    kw.setdefault("api_keys", [API_KEY])
    kw.setdefault("admin_keys", [ADMIN_KEY])
    return AuthMiddleware(app, **kw), hits


async def call_raw(
    app: Any, raw_path: str, key: str | None = None, header: str = "authorization"
) -> tuple[int, dict[str, str], bytes]:
    """One request with an exact raw path, as uvicorn would deliver it (path = decoded once)."""
    headers = [(b"host", b"testserver")]
    if key is not None:
        value = f"Bearer {key}" if header == "authorization" else key
        headers.append((header.encode(), value.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(raw_path),
        "raw_path": raw_path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    hdrs = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], hdrs, body


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def call_headers(app: Any, path: str, *headers: tuple[str, str]) -> int:
    """Status of one GET ``path`` with exactly these headers (in this order)."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")
