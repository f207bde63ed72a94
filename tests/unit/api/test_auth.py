"""AuthMiddleware: keys per route class, decided on the strictest reading of the raw path."""

from __future__ import annotations

import hmac
import json

import pytest
from auth_app import ADMIN_KEY, API_KEY, build, call_headers, call_raw, client

from vlmserve.api.auth import normalize_path

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


# -- path reading ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("/health?next=/admin?x", "/health"),
        (b"/admin/\xff\xfe", "/admin/\ufffd\ufffd"),
        ("/admin/\udcff", "/admin/\ufffd"),
        ("/V1/Models", "/v1/models"),
        ("/v1/%5c..%5cadmin", "/admin"),
        ("/a/b/../../../c", "/c"),
    ],
)
def test_normalize_path_edge_cases(raw: str | bytes, normal: str) -> None:
    assert normalize_path(raw) == normal


def encoded(path: str, rounds: int) -> str:
    """``path`` with its first letter percent-encoded, then every ``%`` encoded again."""
    out = "/%" + format(ord(path[1]), "02x") + path[2:]
    for _ in range(rounds - 1):
        out = out.replace("%", "%25")
    return out


async def test_a_path_still_encoded_after_eight_decoding_rounds_needs_the_admin_key() -> None:
    app, hits = build()
    assert normalize_path(encoded("/v1/models", 8)) == "/v1/models"
    # through auth (the router, which sees the still-encoded path, answers 404)
    assert await call_headers(app, encoded("/v1/models", 8), ("x-api-key", API_KEY)) == 404
    for path in (encoded("/v1/models", 9), encoded("/health", 12)):
        assert await call_headers(app, path, ("x-api-key", API_KEY)) == 401
        assert await call_headers(app, path, ("x-api-key", ADMIN_KEY)) == 404
    assert hits == []


async def test_without_raw_path_the_decoded_path_is_judged() -> None:
    app, hits = build()
    scope_path = "/v1/../admin/state"
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "GET",
        "path": scope_path,
        "query_string": b"",
        "headers": [(b"x-api-key", API_KEY.encode())],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 401
    assert hits == []


async def test_health_spelled_differently_is_still_public() -> None:
    app, _ = build()
    assert await call_headers(app, "/health") == 200
    for variant in ("/health/", "/v1/../health", "/HEALTH"):  # through auth, then the router
        assert await call_headers(app, variant) in (307, 404)


def test_path_classes_are_remembered_for_short_paths_only() -> None:
    from vlmserve.api import auth

    public = frozenset({"/health"})
    auth._classify_remembered.cache_clear()
    assert auth.classify_path("/v1/models", public) is auth.Access.API
    assert auth.classify_path("/v1/models", public) is auth.Access.API
    assert auth._classify_remembered.cache_info().hits == 1
    long_admin = "/" + "a/" * 200 + "../" * 200 + "admin/x"  # normalises to /admin/x
    assert auth.classify_path(long_admin, public) is auth.Access.ADMIN  # the same answer
    assert auth.classify_path(long_admin.encode(), public) is auth.Access.ADMIN
    long_public = "/" + "a/../" * 100 + "health"  # normalises to /health
    assert auth.classify_path(long_public, public) is auth.Access.PUBLIC
    assert auth._classify_remembered.cache_info().currsize == 1  # never held
