"""Whether FastAPI's own OpenTelemetry instrumentation runs: decided once, at start.

FastAPI (0.165 and later) asks on every request whether OpenTelemetry tracing, metrics or logs
are set up, because a provider may be configured after the app is built. Measured in a running
gateway (``benchmarks/hops.py``'s stamping worker, timestamps inside the process, 800 requests,
p50): that check cost ~40 µs of each request's way in, on a path whose whole budget is 1 ms.
A server started from the command line has its OpenTelemetry setup in its environment
(``opentelemetry-instrument``, ``OTEL_*`` variables) or in the code that builds the app before
it builds it, so the question is answered here once: with neither, FastAPI's instrumentation is
off; with either, FastAPI's defaults apply unchanged.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from fastapi import FastAPI

__all__ = ["fastapi_telemetry"]

_UNCONFIGURED = {
    "ProxyTracerProvider",
    "_ProxyMeterProvider",
    "ProxyLoggerProvider",
    "NoOpTracerProvider",
    "NoOpMeterProvider",
    "NoOpLoggerProvider",
}
_OFF = {"tracing": False, "metrics": False, "logs": False}


def fastapi_telemetry(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``FastAPI(**fastapi_telemetry())``: ``telemetry`` off unless OpenTelemetry is set up
    (nothing on a FastAPI without native telemetry)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    env = os.environ if environ is None else environ
    if any(name.startswith("OTEL_") for name in env) or _providers_configured():
        return {}
    return {"telemetry": dict(_OFF)}


def _providers_configured() -> bool:
    """A global tracer, meter or logger provider that is more than OpenTelemetry's stand-in."""
    try:
        from opentelemetry import _logs, metrics, trace  # installed with FastAPI 0.165+
    except ImportError:
        return False
    providers = (
        trace.get_tracer_provider(),
        metrics.get_meter_provider(),
        _logs.get_logger_provider(),
    )
    return any(type(p).__name__ not in _UNCONFIGURED for p in providers)
