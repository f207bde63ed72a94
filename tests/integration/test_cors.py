"""CORS for browser pages on another origin: preflight, exposed headers, and CORS headers on
every answer — errors and unexpected 500s included (a 500 without them reads as a CORS failure
in the browser, hiding the real error)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from support import MODEL

PAGE = "http://console.example:5173"
ORIGIN = {"Origin": PAGE}


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


@pytest.fixture
async def cors_client(make_client: Any) -> httpx.AsyncClient:
    return await make_client(cors_allow_origins=[PAGE])


async def test_preflight_allows_the_methods_and_headers_the_api_uses(
    cors_client: httpx.AsyncClient,
) -> None:
    for method in ("POST", "GET", "DELETE"):
        r = await cors_client.options(
            "/v1/chat/completions",
            headers={
                **ORIGIN,
                "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": "authorization, content-type, last-event-id",
            },
        )
        assert r.status_code == 200, (method, r.text)
        assert r.headers["access-control-allow-origin"] == PAGE
        assert method in r.headers["access-control-allow-methods"]
        allowed = r.headers["access-control-allow-headers"].lower()
        assert {"authorization", "content-type", "last-event-id"} <= set(allowed.split(", "))


async def test_a_stream_exposes_its_session_id_to_page_scripts(
    cors_client: httpx.AsyncClient,
) -> None:
    r = await cors_client.post("/v1/chat/completions", json=_chat(stream=True), headers=ORIGIN)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == PAGE
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-session-id", "x-request-id", "x-resume-token"} <= exposed
    assert r.headers["x-session-id"] and r.headers["x-resume-token"]


async def test_an_origin_not_configured_gets_no_cors_headers(
    cors_client: httpx.AsyncClient,
) -> None:
    r = await cors_client.post(
        "/v1/chat/completions", json=_chat(), headers={"Origin": "http://evil.example"}
    )
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


async def test_client_errors_carry_cors_headers(make_client: Any) -> None:
    client = await make_client(cors_allow_origins=[PAGE], api_keys=["k"])
    unauthorised = await client.post("/v1/chat/completions", json=_chat(), headers=ORIGIN)
    assert unauthorised.status_code == 401
    assert unauthorised.headers["access-control-allow-origin"] == PAGE
    bad = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": []},
        headers={**ORIGIN, "Authorization": "Bearer k"},
    )
    assert bad.status_code == 400
    assert bad.headers["access-control-allow-origin"] == PAGE


async def test_an_unexpected_500_keeps_the_error_shape_request_id_and_cors_headers(
    cors_client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = cors_client._transport.app  # type: ignore[attr-defined]

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(app.state.services.chat, "complete_timed", broken)
    r = await cors_client.post(
        "/v1/chat/completions", json=_chat(), headers={**ORIGIN, "X-Request-ID": "req-500"}
    )
    assert r.status_code == 500
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["x-request-id"] == "req-500"
    error = r.json()["error"]
    assert error["type"] == "internal_error" and error["code"] == "internal_error"
    assert "req-500" in error["message"]
    assert "secret" not in r.text
