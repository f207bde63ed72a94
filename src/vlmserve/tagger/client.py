"""The tagger's calls to an OpenAI-compatible server: model choice by role, retries, limits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from vlmserve.client.http import describe_failure, error_text, normalize_base_url, open_client

__all__ = ["Answer", "RequestFailed", "TagClient", "pick_model"]

_RETRY_STATUS = {429, 502, 503, 504}


class RequestFailed(Exception):
    """A call that failed for good; the message says what the server said."""


@dataclass(slots=True)
class Answer:
    text: str
    finish_reason: str
    model: str


def pick_model(models: list[dict[str, Any]], role: str, fallback: str | None) -> str:
    """``role:<role>`` when a model on the server has that role, else ``fallback``, else the
    first model that is not an embedding model."""
    if any(role in (m.get("roles") or []) for m in models):
        return f"role:{role}"
    if fallback:
        return fallback
    for m in models:
        if "embedding" not in (m.get("roles") or []):
            return str(m["id"])
    raise RequestFailed("the server lists no chat model in /v1/models; pass --model NAME")


def _error_text(response: httpx.Response) -> str:
    return error_text(response.status_code, response.content)


def _retry_after(response: httpx.Response | None, attempt: int) -> float:
    header = response.headers.get("retry-after") if response is not None else None
    try:
        return min(30.0, float(header)) if header else float(attempt)
    except ValueError:
        return float(attempt)


class TagClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        concurrency: int = 4,
        timeout: float = 300.0,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = normalize_base_url(base_url)
        self.timeout = timeout
        self.http = open_client(
            self.base_url,
            api_key=api_key,
            timeout=timeout,
            transport=transport,
            connections=concurrency,
        )
        self.limit = asyncio.Semaphore(concurrency)
        self.retries = retries

    async def __aenter__(self) -> TagClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def models(self) -> list[dict[str, Any]]:
        try:
            response = await self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise RequestFailed(describe_failure(exc, self.base_url, self.timeout)) from exc
        if response.status_code != 200:
            raise RequestFailed(f"GET /v1/models: {_error_text(response)}")
        return list(response.json().get("data") or [])

    async def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(1, self.retries + 1):
            response = None
            try:
                async with self.limit:
                    response = await self.http.post("/v1/chat/completions", json=payload)
            except httpx.TransportError as exc:
                if attempt == self.retries or isinstance(exc, httpx.ReadTimeout):  # slow: no retry
                    raise RequestFailed(describe_failure(exc, self.base_url, self.timeout)) from exc
            else:
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in _RETRY_STATUS or attempt == self.retries:
                    raise RequestFailed(_error_text(response))
            await asyncio.sleep(_retry_after(response, attempt))
        raise AssertionError("unreachable")  # the loop returns or raises

    async def chat(
        self,
        model: str,
        content: list[dict[str, Any]],
        max_tokens: int,
        response_format: dict[str, Any] | None = None,
    ) -> Answer:
        payload: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if response_format is not None:
            payload["response_format"] = response_format
        body = await self._post(payload)
        try:
            choice = body["choices"][0]
            return Answer(
                choice["message"]["content"] or "",
                choice.get("finish_reason") or "",
                str(body.get("model") or model),
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise RequestFailed(f"unexpected answer shape: {str(body)[:200]}") from exc
