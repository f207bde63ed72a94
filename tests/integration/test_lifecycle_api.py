"""Model lifecycle: activate/deactivate/state, on-demand loading, keep_alive, LRU cap, draining."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sse_client import read_events
from support import LiveServer, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import LifecyclePolicy, ModelManager

ADMIN = {"Authorization": "Bearer admin-secret"}


def manager(tiny_dir: Path, **policy: Any) -> ModelManager:
    settings = Settings(device="cpu", engine_process=False)
    handles = [hf_handle(ModelConfig(name=name, source=str(tiny_dir)), settings) for name in "ab"]
    return ModelManager(handles, LifecyclePolicy(**policy))


def settings(tiny_dir: Path) -> Settings:
    return make_settings(tiny_dir, admin_keys=["admin-secret"])


@pytest.fixture
async def app_for(tiny_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    managers: list[ModelManager] = []
    clients: list[httpx.AsyncClient] = []

    async def factory(models: ModelManager) -> httpx.AsyncClient:
        managers.append(models)
        app = build_app(settings(tiny_dir), models=models)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://l")
        client.ctx = ctx  # type: ignore[attr-defined]
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.aclose()
        await client.ctx.__aexit__(None, None, None)  # type: ignore[attr-defined]
    for models in managers:
        models.close()


def chat(model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def state_of(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    models = (await client.get("/admin/state", headers=ADMIN)).json()["models"]
    return next(m for m in models if m["name"] == name)


async def test_activate_deactivate_state_round_trip(app_for: Any, tiny_dir: Path) -> None:
    client = await app_for(manager(tiny_dir, eager=False))
    assert (await state_of(client, "a"))["state"] == "unloaded"
    active = await client.post("/admin/activate", json={"model": "a"}, headers=ADMIN)
    assert active.status_code == 200, active.text
    assert active.json()["state"] == "ready" and active.json()["memory_bytes"] > 0
    assert active.json()["load_seconds"] > 0
    off = await client.post("/admin/deactivate", json={"model": "a"}, headers=ADMIN)
    assert off.json()["state"] == "unloaded" and off.json()["drained"] is True
    assert (await state_of(client, "a"))["memory_bytes"] == 0
    missing = await client.post("/admin/activate", json={"model": "nope"}, headers=ADMIN)
    assert missing.status_code == 404


async def test_on_demand_activation_serves_the_first_request(app_for: Any, tiny_dir: Path) -> None:
    client = await app_for(manager(tiny_dir, eager=False))
    assert (await client.get("/ready")).status_code == 200  # nothing to load eagerly
    r = await client.post("/v1/chat/completions", json=chat("b"))
    assert r.status_code == 200, r.text
    assert (await state_of(client, "b"))["state"] == "ready"
    assert (await state_of(client, "a"))["state"] == "unloaded"


async def test_without_on_demand_an_unloaded_model_is_503(app_for: Any, tiny_dir: Path) -> None:
    client = await app_for(manager(tiny_dir, eager=False, on_demand=False))
    r = await client.post("/v1/chat/completions", json=chat("a"))
    assert r.status_code == 503 and r.headers["retry-after"]
    assert "/admin/activate" in r.json()["error"]["message"]


async def test_lru_cap_unloads_the_least_recently_used(app_for: Any, tiny_dir: Path) -> None:
    client = await app_for(manager(tiny_dir, eager=False, max_loaded=1))
    assert (await client.post("/v1/chat/completions", json=chat("a"))).status_code == 200
    assert (await client.post("/v1/chat/completions", json=chat("b"))).status_code == 200
    assert (await state_of(client, "a"))["state"] == "unloaded"
    assert (await state_of(client, "b"))["state"] == "ready"


async def test_keep_alive_unloads_after_the_timeout_not_before(tiny_dir: Path) -> None:
    # long enough that loading the second model (seconds on a busy 2-core machine) does not
    # already expire the first
    models = manager(tiny_dir, keep_alive=2.0)
    await models.load_all()
    try:
        assert await models.unload_expired() == []
        time.sleep(2.1)
        assert sorted(await models.unload_expired()) == ["a", "b"]
        assert all(h.backend.memory_bytes == 0 for h in models.handles)
    finally:
        models.close()


def test_keep_alive_never_unloads_while_a_stream_is_in_flight(tiny_dir: Path) -> None:
    models = manager(tiny_dir, keep_alive=0.0)
    app = build_app(settings(tiny_dir), models=models)
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
            body = {**chat("a", 3000), "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as response:
                next(response.iter_lines())
                handle = models.resolve("a")
                assert handle.in_flight == 1
                assert handle not in models.expired(now=time.time() + 3600)
                c.post(f"/v1/cancel/{response.headers['x-session-id']}")
            deadline = time.monotonic() + 10
            while models.resolve("a").in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert models.resolve("a") in models.expired(now=time.time() + 1)
    finally:
        models.close()


def test_deactivate_drains_a_stream_in_flight_first(tiny_dir: Path) -> None:
    models = manager(tiny_dir)
    app = build_app(settings(tiny_dir), models=models)
    result: dict[str, Any] = {}
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
            body = {**chat("a", 400), "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as response:
                next(response.iter_lines())
                sid = response.headers["x-session-id"]

                def deactivate() -> None:
                    result["r"] = httpx.post(
                        f"{server.url}/admin/deactivate",
                        json={"model": "a"},
                        headers=ADMIN,
                        timeout=60,
                    )

                worker = threading.Thread(target=deactivate)
                worker.start()
                worker.join(60)
            events, _ = read_events(c, "GET", f"/v1/streams/{sid}")
    finally:
        models.close()
    assert result["r"].json()["drained"] is True
    assert events[-2].finish_reason == "length"  # the stream ran to its end, then unload
