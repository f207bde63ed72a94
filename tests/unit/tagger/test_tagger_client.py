"""The tagger's client against plain-function servers (httpx.MockTransport): model choice,
retries on 503 with Retry-After, errors in the server's own words."""

from __future__ import annotations

import json

import httpx
import pytest

from vlmserve.tagger import RequestFailed, TagClient, TagOptions, resolve_models
from vlmserve.tagger.client import pick_model

LISTED = [
    {"id": "emb", "roles": ["embedding"]},
    {"id": "vlm", "roles": ["chat", "caption"]},
]


def test_a_role_the_server_has_is_asked_for_by_role() -> None:
    assert pick_model(LISTED, "caption", "mine") == "role:caption"


def test_a_missing_role_falls_back_to_model_then_the_first_chat_model() -> None:
    assert pick_model(LISTED, "keywords", "mine") == "mine"
    assert pick_model(LISTED, "keywords", None) == "vlm"
    assert pick_model([{"id": "plain"}], "keywords", None) == "plain"  # e.g. vLLM: no roles
    with pytest.raises(RequestFailed, match="--model"):
        pick_model([{"id": "emb", "roles": ["embedding"]}], "keywords", None)


async def test_models_are_resolved_per_task_from_v1_models(tmp_path) -> None:
    def server(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": LISTED})

    options = TagOptions(root=tmp_path, server="http://x/v1/", model="mine")
    async with TagClient(options.server, transport=httpx.MockTransport(server)) as client:
        models = await resolve_models(client, options)
    assert models == {"caption": "role:caption", "keywords": "mine", "description": "mine"}


def error(code: str, message: str = "loading") -> dict:
    return {"error": {"message": message, "type": "x", "param": None, "code": code}}


def _completion(text: str) -> dict:
    return {"model": "vlm", "choices": [{"message": {"content": text}, "finish_reason": "stop"}]}


async def test_a_busy_server_is_retried_after_its_retry_after() -> None:
    calls: list[dict] = []

    def server(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json=error("model_not_ready"))
        return httpx.Response(200, json=_completion("A cat."))

    transport = httpx.MockTransport(server)
    async with TagClient("http://x", api_key="k", transport=transport) as client:
        answer = await client.chat(
            "vlm", [{"type": "text", "text": "hi"}], 8, {"type": "json_object"}
        )
    assert (answer.text, answer.finish_reason, answer.model) == ("A cat.", "stop", "vlm")
    assert len(calls) == 2
    assert calls[0]["response_format"] == {"type": "json_object"} and calls[0]["max_tokens"] == 8


async def test_a_client_error_fails_at_once_with_the_servers_message() -> None:
    calls = 0

    def server(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(413, json=error("payload_too_large", "video too large"))

    async with TagClient("http://x", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(RequestFailed, match="HTTP 413 payload_too_large: video too large"):
            await client.chat("vlm", [], 8)
    assert calls == 1


async def test_an_unreachable_server_says_so() -> None:
    def server(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async with TagClient("http://x", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(RequestFailed, match="cannot connect"):
            await client.models()
