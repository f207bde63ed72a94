"""AuthMiddleware: the owner identity it puts on a request let through (files, batches)."""

from __future__ import annotations

from typing import Any

from vlmserve.api.auth import ANONYMOUS, AuthMiddleware, owner_of


async def _owner(middleware_kw: dict[str, Any], *headers: tuple[bytes, bytes]) -> Any:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope.get("state", {}).get("owner"))

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        pass

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "headers": list(headers),
    }
    await AuthMiddleware(app, **middleware_kw)(scope, receive, send)
    return seen[0] if seen else None


async def test_each_api_key_is_its_own_owner_and_the_key_itself_is_not_the_identity() -> None:
    keys = {"api_keys": ["k1", "k2"]}
    one = await _owner(keys, (b"authorization", b"Bearer k1"))
    two = await _owner(keys, (b"x-api-key", b"k2"))
    assert one == owner_of(b"k1") and two == owner_of(b"k2") and one != two
    assert "k1" not in one and len(one) == 36
    assert await _owner(keys, (b"x-api-key", b"k1")) == one  # either header, same owner


async def test_without_api_keys_everyone_is_the_anonymous_owner() -> None:
    assert await _owner({}) == ANONYMOUS
    assert await _owner({}, (b"authorization", b"Bearer anything")) == ANONYMOUS
    assert await _owner({"admin_keys": ["a"]}, (b"authorization", b"Bearer a")) == ANONYMOUS


async def test_a_refused_request_reaches_no_owner() -> None:
    assert await _owner({"api_keys": ["k1"]}, (b"authorization", b"Bearer wrong")) is None
