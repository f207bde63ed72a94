"""AuthMiddleware: which headers carry a key, configuration, error responses, other scopes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from auth_app import ADMIN_KEY, API_KEY, build, call_headers, call_raw, client
from fastapi import FastAPI

from vlmserve.api.auth import AuthMiddleware

# -- which header, which scheme -------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer  {API_KEY} "]
)
async def test_bearer_scheme_is_case_insensitive_and_spaces_around_the_key_are_ignored(
    value: str,
) -> None:
    app, hits = build()
    assert await call_headers(app, "/v1/models", ("authorization", value)) == 200
    assert hits == ["models"]


@pytest.mark.parametrize(
    "value", [f"Basic {API_KEY}", f"Token {API_KEY}", API_KEY, f"Bearer{API_KEY}", "Bearer "]
)
async def test_other_authorization_schemes_are_not_keys(value: str) -> None:
    app, hits = build()
    assert await call_headers(app, "/v1/models", ("authorization", value)) == 401
    assert hits == []


@pytest.mark.parametrize("name", ["api-key", "x-api-token", "proxy-authorization", "cookie"])
async def test_only_authorization_and_x_api_key_headers_carry_the_key(name: str) -> None:
    app, hits = build()
    value = f"Bearer {API_KEY}" if "authorization" in name else API_KEY
    assert await call_headers(app, "/v1/models", (name, value)) == 401
    assert hits == []


async def test_authorization_wins_over_x_api_key_when_both_are_sent() -> None:
    app, _ = build()
    bearer_wrong = ("authorization", "Bearer sk-wrong")
    bearer_right = ("authorization", f"Bearer {API_KEY}")
    assert await call_headers(app, "/v1/models", bearer_wrong, ("x-api-key", API_KEY)) == 401
    assert await call_headers(app, "/v1/models", ("x-api-key", "sk-wrong"), bearer_right) == 200


async def test_x_api_key_is_used_when_the_authorization_header_has_no_bearer_key() -> None:
    app, _ = build()
    for authorization in ("Bearer ", f"Basic {ADMIN_KEY}"):
        auth = ("authorization", authorization)
        assert await call_headers(app, "/v1/models", auth, ("x-api-key", API_KEY)) == 200


async def test_the_first_of_repeated_key_headers_counts() -> None:
    app, _ = build()
    for name, good, bad in (
        ("authorization", f"Bearer {API_KEY}", "Bearer sk-wrong"),
        ("x-api-key", API_KEY, "sk-wrong"),
    ):
        assert await call_headers(app, "/v1/models", (name, good), (name, bad)) == 200
        assert await call_headers(app, "/v1/models", (name, bad), (name, good)) == 401


async def test_an_empty_x_api_key_is_no_key() -> None:
    app, _ = build()
    assert await call_headers(app, "/v1/models", ("x-api-key", "  ")) == 401
    assert await call_headers(app, "/v1/models", ("x-api-key", f" {API_KEY} ")) == 200


async def test_a_key_that_is_a_prefix_or_extension_of_a_real_key_is_refused() -> None:
    app, _ = build()
    for guess in (API_KEY[:-1], API_KEY + "0", API_KEY.upper()):
        assert await call_headers(app, "/v1/models", ("x-api-key", guess)) == 401


async def test_any_of_several_api_keys_is_accepted() -> None:
    app, _ = build(api_keys=["sk-first", "sk-second"], admin_keys=[])
    for key in ("sk-first", "sk-second"):
        assert await call_headers(app, "/v1/models", ("x-api-key", key)) == 200
    assert await call_headers(app, "/v1/models", ("x-api-key", "sk-third")) == 401


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["api_keys", "admin_keys"])
def test_one_string_instead_of_a_list_of_keys_is_a_type_error(field: str) -> None:
    """Iterating "secret" would make every one of its characters a valid key."""
    message = r"^api_keys and admin_keys must be sequences of keys, not one string$"
    with pytest.raises(TypeError, match=message):
        AuthMiddleware(FastAPI(), **{field: "secret"})


async def test_empty_keys_in_the_list_are_ignored() -> None:
    app, _ = build(api_keys=["", API_KEY], admin_keys=["", ADMIN_KEY])
    assert await call_headers(app, "/v1/models", ("x-api-key", API_KEY)) == 200
    open_app, _ = build(api_keys=[""], admin_keys=[""])
    assert await call_headers(open_app, "/v1/models") == 200  # no real API key: open
    assert await call_headers(open_app, "/admin/state", ("x-api-key", "")) == 403  # closed


async def test_ready_is_public_by_default_and_public_paths_can_be_changed() -> None:
    app, _ = build()
    assert await call_headers(app, "/ready") == 404  # through auth; no such route in this app
    custom, _ = build(public_paths=["/v1/models"], metrics_public=False)
    assert await call_headers(custom, "/v1/models") == 200
    assert await call_headers(custom, "/health") == 401
    moved, _ = build(metrics_path="/v1/models")
    assert await call_headers(moved, "/v1/models") == 200
    assert await call_headers(moved, "/metrics") == 401


# -- the error responses --------------------------------------------------------------------


async def test_401_body_headers_and_code() -> None:
    app, _ = build()
    status, headers, body = await call_raw(app, "/v1/models", "sk-wrong")
    assert status == 401
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert headers["www-authenticate"] == "Bearer"
    assert json.loads(body) == {
        "error": {
            "message": "missing or invalid key: this route needs an API key; "
            "send it as 'Authorization: Bearer <key>'",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    _, _, admin_body = await call_raw(app, "/admin/state", API_KEY)
    assert "this route needs an admin key;" in json.loads(admin_body)["error"]["message"]


async def test_403_when_admin_is_disabled_is_a_permission_error_without_a_challenge() -> None:
    app, _ = build(admin_keys=[])
    status, headers, body = await call_raw(app, "/admin/state", API_KEY)
    assert status == 403
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert "www-authenticate" not in headers
    assert json.loads(body) == {
        "error": {
            "message": (
                "admin API disabled: set VLMSERVE_ADMIN_KEYS (this route is an admin route: "
                "/admin/* and the gateway's /v1/gateway/*)"
            ),
            "type": "permission_error",
            "param": None,
            "code": "admin_disabled",
        }
    }


# -- websockets and other scopes ------------------------------------------------------------


async def call_websocket(app: Any, path: str, key: str | None = None) -> list[dict]:
    """What the middleware sends for a websocket connect; the inner app records a 'accepted'."""
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    scope = {"type": "websocket", "path": path, "raw_path": path.encode(), "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def recording_app() -> tuple[list[str], Any]:
    """An inner app that records each scope type and uses the receive and send it was given."""
    seen: list[str] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        message = await receive()
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
        elif scope["type"] == "lifespan":
            await send({"type": message["type"] + ".complete"})
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": message["body"]})

    return seen, inner


async def test_websocket_without_the_key_is_closed_with_policy_violation() -> None:
    seen, inner = recording_app()
    app = AuthMiddleware(inner, api_keys=[API_KEY], admin_keys=[ADMIN_KEY])
    assert await call_websocket(app, "/v1/realtime") == [{"type": "websocket.close", "code": 1008}]
    assert await call_websocket(app, "/admin/ws", API_KEY) == [
        {"type": "websocket.close", "code": 1008}
    ]
    assert seen == []
    assert await call_websocket(app, "/v1/realtime", API_KEY) == [{"type": "websocket.accept"}]
    assert seen == ["websocket"]


async def test_lifespan_and_other_scopes_pass_through_untouched() -> None:
    seen, inner = recording_app()
    app = AuthMiddleware(inner, api_keys=[API_KEY], admin_keys=[ADMIN_KEY])

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "lifespan.startup"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, receive, send)
    assert seen == ["lifespan"]
    assert sent == [{"type": "lifespan.startup.complete"}]  # the inner app's own answer


async def test_an_allowed_request_reaches_the_app_with_its_body() -> None:
    seen, inner = recording_app()
    app = AuthMiddleware(inner, api_keys=[API_KEY])
    async with client(app) as c:
        r = await c.post("/v1/echo", content=b"payload", headers={"x-api-key": API_KEY})
    assert (r.status_code, r.content, seen) == (200, b"payload", ["http"])


async def test_a_scope_without_headers_is_a_request_without_a_key() -> None:
    app, hits = build()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "GET", "path": "/v1/models"}, receive, send)
    assert sent[0]["status"] == 401 and hits == []


async def test_a_scope_without_a_path_is_judged_as_the_root() -> None:
    seen, inner = recording_app()
    app = AuthMiddleware(inner, api_keys=[API_KEY], public_paths=["/"])
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    for scope in ({"type": "http", "headers": []}, {"type": "http", "path": "", "headers": []}):
        await app(scope, receive, send)
    assert [m["status"] for m in sent if "status" in m] == [200, 200]
    assert seen == ["http", "http"]
