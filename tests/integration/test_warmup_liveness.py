"""Warm-up and liveness through the API (in-process app, tiny Qwen2-VL, its own model).

Pinned: ``/ready`` stays 503 until the model has answered its text and image warm-up
requests (and ``--no-warmup`` skips them); an engine made to stop stepping with a request
pending is reported failed by ``/health`` within the liveness timeout, its request ends
with a 503, and the model is reloaded and serves again; a slow engine that keeps stepping
is not failed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.registry.manager import ModelManager

pytestmark = pytest.mark.timeout(120)


def chat(text: str = "Hello", **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    return {**body, **extra}


@pytest.fixture
async def serve(tiny_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await serve(**settings)`` -> (client, manager): an app with its own model, loading
    in the background as ``vlmserve serve`` does (the client is usable at once)."""
    stack: list[Any] = []

    async def start(**overrides: Any) -> tuple[httpx.AsyncClient, ModelManager]:
        settings = make_settings(tiny_dir, max_num_seqs=4, **overrides)
        models = ModelManager.from_settings(settings)
        models.policy.reload_backoff = 0.2
        app = build_app(settings, models=models)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        transport = httpx.ASGITransport(app=app)
        client = httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60)
        stack.append((ctx, client, models))
        return client, models

    yield start
    for ctx, client, models in reversed(stack):
        await client.aclose()
        await ctx.__aexit__(None, None, None)
        models.close()


def backend_of(models: ModelManager) -> HFChatBackend:
    backend = models.resolve(MODEL).backend
    assert isinstance(backend, HFChatBackend)
    return backend


async def first_ready(
    client: httpx.AsyncClient, models: ModelManager, *, engine: bool = True
) -> dict[str, Any]:
    """Poll ``/ready`` until 200; what the engine had done by then, and whether a poll saw
    the model loaded but still warming (``engine``: an in-process engine to look at)."""
    seen_warming = False
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        loaded = not engine or backend_of(models).engine is not None
        r = await client.get("/ready")
        if r.status_code == 200 and not engine:
            return {"warming_seen": seen_warming}
        if r.status_code == 200:
            engine = backend_of(models).engine
            assert engine is not None
            return {"prompts": engine.prefilled_rows, "warming_seen": seen_warming}
        seen_warming |= loaded and models.handles[0].warming
        await asyncio.sleep(0.002)
    raise AssertionError("never ready")


@pytest.mark.parametrize("keys", [[], ["k1"]], ids=["open", "with-api-keys"])
async def test_ready_waits_for_the_text_and_image_warm_up_requests(
    serve: Any, keys: list[str]
) -> None:
    client, models = await serve(api_keys=keys)
    client.headers["Authorization"] = "Bearer k1"
    state = await first_ready(client, models)
    # the model's text and image requests, then the request path's streamed one
    assert state["prompts"] == 3
    assert state["warming_seen"]  # loaded, yet /ready said 503 while they ran
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text


async def test_no_warmup_is_ready_as_soon_as_loaded(serve: Any) -> None:
    client, models = await serve(warmup=False)
    state = await first_ready(client, models)
    assert state["prompts"] == 0 and not state["warming_seen"]


async def health_state(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/health")).json()["models"][0]


async def test_an_engine_that_stops_stepping_is_failed_within_the_timeout_and_reloaded(
    serve: Any,
) -> None:
    client, models = await serve(liveness_timeout=1.0)
    await first_ready(client, models)
    engine = backend_of(models).engine
    assert engine is not None
    stuck, entered = threading.Event(), threading.Event()
    decode = engine.runner.decode

    def hang(*args: Any, **kw: Any) -> Any:  # the fault: a decode step that never returns
        entered.set()
        stuck.wait(60)
        return decode(*args, **kw)

    engine.runner.decode = hang
    try:
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        began = time.monotonic()
        while (await health_state(client))["state"] != "failed":
            assert time.monotonic() - began < 1.0 + 1.0, "not reported failed in time"
            await asyncio.sleep(0.02)
        reported = time.monotonic() - began
        assert reported >= 0.9  # not before the timeout
        r = await pending
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        health = (await client.get("/health")).json()
        assert "liveness" in (health["error"] or "") or "no engine step" in (health["error"] or "")
        deadline = time.monotonic() + 60
        while (await health_state(client))["state"] != "ready":
            assert time.monotonic() < deadline, "not reloaded"
            await asyncio.sleep(0.05)
        again = await client.post("/v1/chat/completions", json=chat())
        assert again.status_code == 200, again.text
        assert backend_of(models).engine is not engine  # a new engine serves
    finally:
        stuck.set()  # let the abandoned engine thread finish


async def test_a_slow_engine_that_keeps_stepping_is_not_failed(serve: Any) -> None:
    client, models = await serve(liveness_timeout=1.0)
    await first_ready(client, models)
    engine = backend_of(models).engine
    assert engine is not None
    decode = engine.runner.decode

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(0.3)
        return decode(*args, **kw)

    engine.runner.decode = slow
    body = chat(max_tokens=8, stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    assert len(events) >= 2 and "error" not in json.loads(events[-1][6:])
    assert (await health_state(client))["state"] == "ready"
    assert backend_of(models).engine is engine


async def test_an_engine_process_that_stops_is_failed_and_replaced(serve: Any) -> None:
    """The product's default: the engine in its own process, here frozen (SIGSTOP) with a
    request on its way; its reports stop, the model fails within the timeout, the request
    gets a 503, the process is killed and a new one serves."""
    client, models = await serve(liveness_timeout=1.0, engine_process=True)
    await first_ready(client, models, engine=False)
    backend = models.resolve(MODEL).backend
    pid = backend.describe()["engine_process"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    assert time.monotonic() - began < 1.0 + 1.5, "not failed in time"
    assert (await health_state(client))["state"] in ("failed", "loading")
    deadline = time.monotonic() + 120
    while (await health_state(client))["state"] != "ready":
        assert time.monotonic() < deadline, "not reloaded"
        await asyncio.sleep(0.1)
    assert backend.describe()["engine_process"]["pid"] != pid
    again = await client.post("/v1/chat/completions", json=chat())
    assert again.status_code == 200, again.text
