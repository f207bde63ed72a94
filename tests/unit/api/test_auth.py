"""AuthMiddleware: keys per route class, decided on the strictest reading of the raw path."""

from __future__ import annotations

import hmac
import json
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from fastapi import FastAPI

from vlmserve.api.auth import AuthMiddleware, normalize_path

API_KEY = "sk-api-0123456789"
ADMIN_KEY = "sk-admin-9876543210"

BYPASS_TO_ADMIN = [
    "/v1/../admin/state",
    "//admin/state",
    "/ADMIN/state",
    "/admin/state/",
    "/%61dmin/state",
    "/%2561dmin/state",
    "/v1%2f..%2fadmin/state",
    "/v1/%2e%2e/admin/state",
    "/./admin/state",
    "/health/../admin/state",
    "/v1\\..\\admin/state",
]
BYPASS_TO_V1 = ["//v1/models", "/V1/models", "/v1/models/", "/%761/models", "/./v1/models"]


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


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("/v1/../admin/state", "/admin/state"),
        ("//ADMIN//state/", "/admin/state"),
        ("/v1%2f..%2fadmin", "/admin"),
        ("/%252e%252e/admin", "/admin"),
        ("/../../admin", "/admin"),
        ("/", "/"),
    ],
)
def test_normalize_path_is_the_strictest_reading(raw: str, normal: str) -> None:
    assert normalize_path(raw) == normal


async def test_v1_needs_an_api_key_and_accepts_api_or_admin_key() -> None:
    app, hits = build()
    async with client(app) as c:
        missing = await c.get("/v1/models")
        wrong = await c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        ok = await c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        admin = await c.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        x_api = await c.get("/v1/models", headers={"x-api-key": API_KEY})
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert (ok.status_code, admin.status_code, x_api.status_code) == (200, 200, 200)
    assert hits == ["models", "models", "models"]


async def test_401_is_openai_shaped_with_www_authenticate_and_never_echoes_the_key() -> None:
    app, _ = build()
    async with client(app) as c:
        r = await c.get("/v1/models", headers={"Authorization": "Bearer sk-secret-guess"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"
    assert "sk-secret-guess" not in r.text


@pytest.mark.parametrize("raw", BYPASS_TO_V1)
async def test_v1_path_variants_need_a_key(raw: str) -> None:
    app, hits = build()
    for key in (None, "sk-wrong"):
        status, headers, _ = await call_raw(app, raw, key)
        assert status == 401, (raw, key)
        assert headers["www-authenticate"] == "Bearer"
    assert hits == []


@pytest.mark.parametrize("raw", ["/admin/state", *BYPASS_TO_ADMIN])
async def test_admin_variants_reject_no_key_wrong_key_and_the_api_key(raw: str) -> None:
    app, hits = build()
    for key in (None, "sk-wrong", API_KEY):
        for header in ("authorization", "x-api-key"):
            status, _, body = await call_raw(app, raw, key, header)
            assert status == 401, (raw, key, header)
            assert API_KEY.encode() not in body
    assert hits == []


async def test_admin_route_accepts_the_admin_key() -> None:
    app, hits = build()
    status, _, body = await call_raw(app, "/admin/state", ADMIN_KEY)
    assert status == 200
    assert json.loads(body) == {"models": []}
    assert hits == ["admin"]


async def test_admin_is_closed_with_403_when_no_admin_keys_are_configured() -> None:
    app, hits = build(admin_keys=[])
    for key in (None, API_KEY, "anything"):
        status, _, body = await call_raw(app, "/admin/state", key)
        assert status == 403
        assert "VLMSERVE_ADMIN_KEYS" in json.loads(body)["error"]["message"]
    assert hits == []


async def test_v1_is_open_without_api_keys_but_admin_stays_guarded() -> None:
    app, hits = build(api_keys=[])
    assert (await call_raw(app, "/v1/models"))[0] == 200
    assert (await call_raw(app, "/v1/../admin/state"))[0] == 401
    assert (await call_raw(app, "/admin/state", ADMIN_KEY))[0] == 200
    assert hits == ["models", "admin"]


async def test_health_and_metrics_are_public_and_metrics_can_be_closed() -> None:
    app, _ = build()
    assert (await call_raw(app, "/health"))[0] == 200
    assert (await call_raw(app, "/metrics"))[0] == 200
    closed, _ = build(metrics_public=False)
    assert (await call_raw(closed, "/metrics"))[0] == 401
    assert (await call_raw(closed, "/metrics", API_KEY))[0] == 200


async def test_raw_path_wins_when_it_is_stricter_than_the_decoded_path() -> None:
    """If the decoded path and the raw path disagree, the stricter class applies."""
    app, hits = build()
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/health",  # what a lax decoder might hand the router
        "raw_path": b"/%61dmin/state",  # what the client actually sent
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {API_KEY}".encode())],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 401
    assert hits == []


async def test_host_header_is_ignored() -> None:
    app, hits = build()
    async with client(app) as c:
        r = await c.get("/admin/state", headers={"Host": "evil/health?", "x-api-key": API_KEY})
    assert r.status_code == 401
    assert hits == []


async def test_keys_are_compared_with_compare_digest_against_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    app, _ = build(api_keys=[API_KEY, "sk-second"], admin_keys=[ADMIN_KEY])
    assert (await call_raw(app, "/v1/models", API_KEY))[0] == 200
    assert len(calls) == 3  # no early exit on the first match: api keys + admin key
    calls.clear()
    assert (await call_raw(app, "/admin/state", API_KEY))[0] == 401
    assert len(calls) == 1  # admin routes compare against admin keys only
