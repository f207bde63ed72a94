"""The gateway's byte pass-through against upstreams on real sockets that say they are
vlmserve workers: what a client gets when the replica breaks off, refuses, or is over the
gateway's own limits (``gateway/passthrough.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from upstreams import fake_upstreams
from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.registry.manager import ModelHandle, ModelManager

pytestmark = pytest.mark.timeout(60)

HEALTH = {"ok": True, "modelReady": True, "resumableStreams": True}
EVENT = {
    "id": "chatcmpl-up1",
    "object": "chat.completion.chunk",
    "model": "up",
    "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
}
seen: list[httpx.Request] = []
health = dict(HEALTH)  # what the fake replica's /health says
KEY = "client-key"


async def _cut_after_one_event() -> AsyncIterator[bytes]:
    yield f"data: {json.dumps(EVENT, separators=(',', ':'))}\n\n".encode()
    await asyncio.sleep(0.05)
    raise httpx.ReadError("the replica died")


def worker_like(request: httpx.Request) -> httpx.Response:
    """A replica that says it runs resumable streams; its chat stream breaks after one event,
    and a request with ``"max_tokens": -1`` gets its 400."""
    if request.url.path == "/health":
        return httpx.Response(200, json=health)
    seen.append(request)
    later = later_answer(request)
    if later is not None:
        return later
    body = json.loads(request.content)
    if not body.get("stream"):
        answer = {
            "id": "chatcmpl-up2",
            "object": "chat.completion",
            "model": "up",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hi"},
                    "finish_reason": "stop",
                }
            ],
        }
        return httpx.Response(
            200,
            content=json.dumps(answer, separators=(",", ":")),
            headers={"content-type": "application/json"},
        )
    if body.get("max_tokens") == -1:
        error = {
            "error": {
                "message": "max_tokens must be positive",
                "param": "max_tokens",
                "type": "invalid_request_error",
                "code": None,
            }
        }
        return httpx.Response(400, json=error)
    headers = {"content-type": "text/event-stream", "x-session-id": "s-up"}
    return httpx.Response(200, headers=headers, content=_cut_after_one_event())


def later_answer(request: httpx.Request) -> httpx.Response | None:
    """A stream's later requests: a replay of its one event, or a cancel (None: chat)."""
    path = request.url.path
    if path.startswith("/v1/streams/"):
        replay = f"id: s-up:0\ndata: {json.dumps(EVENT, separators=(',', ':'))}\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=replay)
    if path.startswith("/v1/cancel/") or path.endswith("/cancel"):
        return httpx.Response(200, json={"cancelled": True})
    if path != "/v1/chat/completions":
        return httpx.Response(404, json={"error": {"message": path}})
    if "last-event-id" in request.headers:
        return later_answer(httpx.Request("GET", "http://w/v1/streams/s-up"))
    return None


@contextlib.asynccontextmanager
async def gateway_app(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway in process over one fake replica, its client holding the gateway's API key."""
    seen.clear()
    async with contextlib.AsyncExitStack() as stack:
        up = await stack.enter_async_context(fake_upstreams(worker_like, "http://w"))
        config = UpstreamConfig(
            model="up",
            base_urls=up.real("http://w"),
            health_interval=0,
            preflight=False,
            policy=PoolPolicy(max_failures=5),
        )
        models = ModelManager([ModelHandle("gw", ["chat"], UpstreamBackend("gw", config))])
        base = {"device": "cpu", "max_body_bytes": 4096, "max_n": 2, "api_keys": [KEY]}
        app = build_app(Settings(**{**base, **settings}), models=models)
        await stack.enter_async_context(app.router.lifespan_context(app))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://gw",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        yield await stack.enter_async_context(client)
        await models.aclose()


@pytest.fixture
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_app() as client:
        yield client


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gw", "stream": True, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_a_replica_that_breaks_off_ends_the_passed_stream_with_an_error_event(
    gateway: httpx.AsyncClient,
) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200 and r.headers["x-session-id"] == "s-up"
    messages = [m for m in r.text.split("\n\n") if m]
    first = json.loads(messages[0].removeprefix("data: "))
    assert first["model"] == "gw" and first["choices"][0]["delta"]["content"] == "Hi"
    error = json.loads(messages[1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error"
    assert messages[-1] == "data: [DONE]"
    assert json.loads(seen[0].content)["model"] == "up"  # the upstream's name for it


async def test_the_replicas_400_reaches_the_client_in_the_openai_shape(
    gateway: httpx.AsyncClient,
) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat(max_tokens=-1))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert len(seen) == 1  # the replica's own 400 (the full path would refuse it itself)


async def test_a_whole_answer_passes_renamed(gateway: httpx.AsyncClient) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat(stream=False))
    assert r.status_code == 200 and r.json()["model"] == "gw"
    assert r.json()["choices"][0]["message"]["content"] == "Hi"


async def test_a_session_id_of_a_passed_stream_is_taken(gateway: httpx.AsyncClient) -> None:
    first = await gateway.post("/v1/chat/completions", json=chat(session_id="s-up"))
    assert first.status_code == 200
    again = await gateway.post("/v1/chat/completions", json=chat(session_id="s-up"))
    assert again.status_code == 400 and again.json()["error"]["code"] == "session_exists"
    assert len(seen) == 1


async def test_a_malformed_part_is_the_workers_to_refuse_not_a_gateway_crash(
    gateway: httpx.AsyncClient,
) -> None:
    part = {"type": ["image_url"], "image_url": {"url": "data:"}}  # a list is no part type
    body = chat(messages=[{"role": "user", "content": [part]}])
    r = await gateway.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(seen) == 1  # this fake worker takes anything


async def test_the_gateways_limits_hold_before_anything_is_passed(
    gateway: httpx.AsyncClient,
) -> None:
    big = await gateway.post("/v1/chat/completions", json=chat(pad="x" * 5000))
    assert big.status_code == 413
    over = await gateway.post("/v1/chat/completions", json=chat(n=3))
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"
    assert seen == []  # neither reached the replica


async def test_a_passed_streams_later_requests_reach_its_replica_without_the_clients_key(
    gateway: httpx.AsyncClient,
) -> None:
    started = await gateway.post(
        "/v1/chat/completions", json=chat(), headers={"Accept": "text/event-stream"}
    )
    assert started.status_code == 200
    resumed = await gateway.get("/v1/streams/s-up", headers={"Last-Event-ID": "s-up:0"})
    assert resumed.status_code == 200 and '"model":"gw"' in resumed.text  # renamed
    by_query = await gateway.get("/v1/streams/s-up", params={"last_event_id": "s-up:0"})
    reposted = await gateway.post(
        "/v1/chat/completions", json=chat(), headers={"Last-Event-ID": "s-up:0"}
    )
    cancelled = await gateway.post("/v1/cancel/s-up")
    by_completion = await gateway.post("/v1/chat/completions/chatcmpl-up1/cancel")
    unknown = await gateway.get("/v1/streams/nope")
    assert [r.status_code for r in (by_query, reposted, cancelled, by_completion)] == [200] * 4
    assert unknown.status_code == 404  # not a passed stream: the gateway's own 404
    got = [(r.method, r.url.path, unquote(r.url.query.decode())) for r in seen]  # as sent
    assert got == [
        ("POST", "/v1/chat/completions", ""),
        ("GET", "/v1/streams/s-up", ""),
        ("GET", "/v1/streams/s-up", "last_event_id=s-up:0"),
        ("POST", "/v1/chat/completions", ""),
        ("POST", "/v1/cancel/s-up", ""),
        ("POST", "/v1/chat/completions/chatcmpl-up1/cancel", ""),
    ]
    assert seen[0].headers["accept"] == "text/event-stream"
    assert seen[1].headers["last-event-id"] == "s-up:0" == seen[3].headers["last-event-id"]
    assert seen[1].headers["x-request-id"] == resumed.headers["x-request-id"]
    assert seen[0].headers["content-type"] == "application/json"
    assert not any("authorization" in r.headers or "x-api-key" in r.headers for r in seen)
    assert json.loads(seen[3].content) == chat()


@pytest.mark.parametrize("settings", [{"gateway_passthrough": False}, {"persist_sessions": True}])
async def test_off_or_with_a_durable_store_the_gateway_runs_its_own_sessions(
    settings: dict[str, Any], tmp_path: Any
) -> None:
    if settings.get("persist_sessions"):
        settings["sessions_db_path"] = str(tmp_path / "sessions.db")
    async with gateway_app(**settings) as client:
        r = await client.post("/v1/chat/completions", json=chat(session_id="mine"))
    assert r.status_code == 200 and r.headers["x-session-id"] == "mine"
    sent = json.loads(seen[0].content)  # the full path's own upstream body
    assert "session_id" not in sent and sent["stream_options"] == {"include_usage": True}


async def test_a_replica_that_is_no_vlmserve_worker_gets_the_full_path() -> None:
    health.pop("resumableStreams")
    try:
        async with gateway_app() as client:  # the model loads on the first request
            first = await client.post("/v1/chat/completions", json=chat(session_id="a"))
            second = await client.post("/v1/chat/completions", json=chat(session_id="b"))
    finally:
        health.update(HEALTH)
    assert [first.headers["x-session-id"], second.headers["x-session-id"]] == ["a", "b"]
    chats = [r for r in seen if r.url.path == "/v1/chat/completions"]  # (and its cancels)
    sent = [json.loads(r.content) for r in chats]  # the full path's own upstream bodies
    assert all(b["stream_options"] == {"include_usage": True} for b in sent) and len(sent) == 2


@pytest.mark.parametrize("passthrough", [True, False])
async def test_fields_refused_for_local_models_reach_a_proxied_one_as_sent(
    passthrough: bool,
) -> None:
    extra = {
        "guided_json": {"type": "object"},
        "mm_processor_kwargs": {"max_pixels": 1000},
        "logit_bias": {"7": 5},
        "repetition_detection": {"max_pattern_size": 8, "min_count": 3},
        "thinking_token_budget": 8,
        "allowed_token_ids": [1, 2],
        "frobnicate": 1,
    }
    async with gateway_app(gateway_passthrough=passthrough) as gateway:
        r = await gateway.post("/v1/chat/completions", json=chat(stream=False, **extra))
        assert r.status_code != 400, r.text  # (this fake replica breaks off full-path streams)
        sent = json.loads(seen[0].content)
    assert {k: sent[k] for k in extra} == extra


def keyless(request: httpx.Request) -> httpx.Request:
    del request.headers["authorization"]
    return request


async def test_a_passed_stream_is_its_keys_alone_through_the_gateway() -> None:
    """The workers see one key, the gateway's: the gateway keeps its clients' keys apart.
    Another key's resume or cancel of a passed stream is an unknown id's 404 that never
    reaches the replica; a client's own ``session_id`` is kept per key."""
    other = {"Authorization": "Bearer other-key"}
    async with gateway_app(api_keys=[KEY, "other-key"]) as gateway:
        started = await gateway.post("/v1/chat/completions", json=chat())
        assert started.status_code == 200 and started.headers["x-session-id"] == "s-up"
        unknown = await gateway.get("/v1/streams/s-uq", headers=other)
        for answer in (
            await gateway.get("/v1/streams/s-up", headers=other),
            await gateway.get("/v1/streams/s-up", headers={**other, "Last-Event-ID": "s-up:0"}),
            await gateway.post(
                "/v1/chat/completions", json=chat(), headers={**other, "Last-Event-ID": "s-up:0"}
            ),
            await gateway.post("/v1/cancel/s-up", headers=other),
            await gateway.post("/v1/chat/completions/chatcmpl-up1/cancel", headers=other),
            await gateway.send(
                keyless(gateway.build_request("GET", "/v1/streams/s-up", params={"token": "guess"}))
            ),
        ):
            assert answer.status_code == 404, answer.text
        assert unknown.status_code == 404
        assert len(seen) == 1  # none of them reached the replica
        assert (await gateway.get("/v1/streams/s-up")).status_code == 200  # the owner's
        for key in ({}, other):  # each key's own "mine": the gateway runs both sessions
            mine = await gateway.post(
                "/v1/chat/completions", json=chat(session_id="mine"), headers=key
            )
            assert mine.status_code == 200 and mine.headers["x-session-id"] == "mine"
        chats = [json.loads(r.content) for r in seen[2:] if r.url.path == "/v1/chat/completions"]
        assert [body.get("session_id") for body in chats] == [None, None]
