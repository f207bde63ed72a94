"""FastAPI's OpenTelemetry instrumentation: off unless OpenTelemetry is set up at start."""

from __future__ import annotations

import inspect

import httpx
import pytest
from fastapi import FastAPI

from vlmserve.api import telemetry
from vlmserve.api.app import build_app
from vlmserve.api.telemetry import fastapi_telemetry
from vlmserve.config import Settings

native = pytest.mark.skipif(
    "telemetry" not in inspect.signature(FastAPI.__init__).parameters,
    reason="this FastAPI has no native telemetry",
)


@native
def test_without_any_setup_fastapis_per_request_check_is_off() -> None:
    app = build_app(Settings(device="cpu"))
    assert not app._native_telemetry.enabled()
    assert fastapi_telemetry({}) == {
        "telemetry": {"tracing": False, "metrics": False, "logs": False}
    }


@native
def test_an_otel_variable_or_a_configured_provider_keeps_fastapis_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert fastapi_telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == {}
    assert fastapi_telemetry({"OTELX": "1", "PATH": "/bin"}) != {}  # only OTEL_ names count

    class SdkTracerProvider:  # what an SDK's provider looks like to this check: not a stand-in
        pass

    from opentelemetry import trace

    monkeypatch.setattr(trace, "get_tracer_provider", SdkTracerProvider)
    assert fastapi_telemetry({}) == {}


@native
async def test_requests_are_served_with_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(telemetry, "_providers_configured", lambda: calls.append(1) or False)
    app = build_app(Settings(device="cpu"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        assert (await client.get("/health")).status_code == 200
    assert calls == [1]  # asked once, when the app was built
