"""The gateway's control routes are admin routes: adding a replica sends it users' prompts
and images, and the replica list shows upstream URLs — so an admin key, and 403 without any."""

from __future__ import annotations

import json

import pytest
from auth_app import ADMIN_KEY, API_KEY, build, call_raw

GATEWAY_PATHS = [
    "/v1/gateway/register",
    "/v1/gateway/replicas",
    "/v1/gateway/deregister",
    "//v1//gateway/register",
    "/V1/Gateway/replicas",
    "/v1/gateway/replicas/",
    "/v1/%67ateway/register",
    "/v1/models/../gateway/register",
]


@pytest.mark.parametrize("raw", GATEWAY_PATHS)
async def test_gateway_routes_refuse_no_key_a_wrong_key_and_the_api_key(raw: str) -> None:
    app, hits = build()
    for key in (None, "sk-wrong", API_KEY):
        status, headers, body = await call_raw(app, raw, key)
        assert status == 401, (raw, key)
        assert headers["www-authenticate"] == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert hits == []


@pytest.mark.parametrize("raw", GATEWAY_PATHS[:3])
async def test_gateway_routes_pass_with_the_admin_key(raw: str) -> None:
    app, _ = build()
    status, _, _ = await call_raw(app, raw, ADMIN_KEY)
    assert status == 404  # through auth: the test app has no gateway routes


@pytest.mark.parametrize("api_keys", [[], [API_KEY]])
async def test_gateway_routes_are_closed_with_403_without_admin_keys(api_keys: list[str]) -> None:
    app, hits = build(api_keys=api_keys, admin_keys=[])
    for raw in GATEWAY_PATHS:
        for key in (None, API_KEY):
            status, _, body = await call_raw(app, raw, key)
            assert status == 403, (raw, key)
            error = json.loads(body)["error"]
            assert error["code"] == "admin_disabled" and error["type"] == "permission_error"
            assert "VLMSERVE_ADMIN_KEYS" in error["message"]
    assert hits == []
