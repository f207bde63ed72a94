"""What preflight and the load tester share: base URLs, auth headers, the client, error text.

Light on purpose (httpx and stdlib only): ``vlmserve preflight`` must start in well under a
second, so nothing here may pull in torch, transformers or fastapi.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

__all__ = [
    "ServerUnreachable",
    "describe_failure",
    "error_text",
    "normalize_base_url",
    "open_client",
]


class ServerUnreachable(Exception):
    """The server could not be reached (or refused our credentials) before any real work."""


def normalize_base_url(url: str) -> str:
    """``http://h:8000/v1/`` and ``h:8000`` -> ``http://h:8000`` (routes add ``/v1/...``)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def open_client(
    base_url: str,
    *,
    api_key: str | None,
    timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
    connections: int = 16,
) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=normalize_base_url(base_url),
        headers=headers,
        timeout=httpx.Timeout(timeout),
        limits=limits,
        transport=transport,
    )


def error_text(status: int, body: bytes | str) -> str:
    """``HTTP 400 model_capability_missing: <message>`` from an OpenAI error body (or raw text)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message, code = text.strip()[:300], None
    try:
        error: Any = json.loads(text).get("error")
        if isinstance(error, dict):
            message, code = str(error.get("message") or message), error.get("code")
        elif isinstance(error, str):
            message = error
    except (ValueError, AttributeError):
        pass
    hint = " (pass --api-key)" if status in (401, 403) else ""
    return f"HTTP {status}{f' {code}' if code else ''}: {message}{hint}"


def describe_failure(exc: httpx.HTTPError, url: str, timeout: float) -> str:
    """A transport failure in words that say what to try next."""
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g}s ({type(exc).__name__}); raise --timeout"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url}: {exc or 'refused'}; is the server running there?"
    return f"{type(exc).__name__}: {exc}"
