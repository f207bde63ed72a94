"""A worker registering with a gateway: a refused key stops it with one clear error; a model the
gateway refuses for another reason does not stop the others."""

from __future__ import annotations

import logging

import httpx
import pytest

from vlmserve.gateway.registration_worker import Registration


def _worker(statuses: dict[str, int], seen: list[str]) -> Registration:
    def gateway(request: httpx.Request) -> httpx.Response:
        model = httpx.Response(200, content=request.content).json()["model"]
        seen.append(model)
        return httpx.Response(statuses.get(model, 200), json={})

    return Registration(
        "http://gw/v1/gateway/register",
        "http://w:8000",
        instance="w",
        attempts=3,
        backoff=0,
        transport=httpx.MockTransport(gateway),
    )


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_key_stops_at_the_first_model_with_one_error_naming_the_setting(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    worker = _worker({"a": status, "b": status}, seen)
    with caplog.at_level(logging.ERROR, logger="vlmserve.gateway.registration_worker"):
        assert await worker.register(["a", "b", "c"]) is False
    assert seen == ["a"]  # not retried, and no other model tried
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "VLMSERVE_GATEWAY_KEY" in errors[0].getMessage()


async def test_another_refusal_does_not_stop_the_other_models() -> None:
    seen: list[str] = []
    worker = _worker({"a": 404}, seen)
    assert await worker.register(["a", "b"]) is False
    assert seen == ["a", "b"]
    seen.clear()
    assert await _worker({}, seen).register(["a", "b"]) is True
