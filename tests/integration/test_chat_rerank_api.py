"""One model served with the ``chat`` and ``rerank`` roles (a Qwen3-VL-Reranker-layout tiny
checkpoint), through the API: it answers /v1/chat/completions and /v1/rerank from one copy of
the weights, and an image is run through the vision tower once whichever route saw it first
(the chat engine's vision cache serves both), in this process and in an engine process; a
gateway entry with both roles relays both."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from upstreams import serve_asgi
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.families.rerankers import build_qwen3_vl_reranker
from vlmserve.testing.media import data_url, image_bytes

NAME = "tiny-qwen3-chat-rerank"

Served = tuple[httpx.AsyncClient, ModelManager]


@asynccontextmanager
async def serving(engine_process: bool) -> AsyncIterator[Served]:
    model = ModelConfig(name=NAME, source=str(build_qwen3_vl_reranker()), roles=["chat", "rerank"])
    settings = Settings(
        models=[model], device="cpu", engine_process=engine_process, media_workers=0
    )
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        await handle.backend.aload()
    app = build_app(settings, models=models)
    try:
        async with (
            serve_asgi(app) as url,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            yield client, models
    finally:
        await models.aclose()


def tower_counter(models: ModelManager, engine_process: bool) -> Callable[[], int]:
    """Images and videos run through the vision tower so far: its forward calls counted by a
    hook in this process, else the engine process's vision-cache misses (its stats)."""
    backend: Any = models.resolve(NAME).backend
    if engine_process:
        return lambda: int((backend.stats().vision_cache or {}).get("misses", 0))
    calls = [0]
    visual = backend._require().model.model.visual
    visual.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return lambda: calls[0]


async def settled(count: Callable[[], int], expected: int, timeout: float = 10.0) -> int:
    """``count()`` once it reached ``expected`` (engine-process stats arrive periodically),
    or its value after ``timeout``."""
    deadline = time.monotonic() + timeout
    while count() < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.6 if count() >= expected else 0)  # a later report would show more
    return count()


async def chat(client: httpx.AsyncClient, image: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "?"}]
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


async def rerank(client: httpx.AsyncClient, image: str) -> list[Any]:
    body = {"model": NAME, "query": "a gradient", "documents": [{"image": image}, "the sun"]}
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["results"])


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_chat_and_rerank_share_the_vision_tower_outputs(engine_process: bool) -> None:
    first = data_url(image_bytes(64, 48, seed=1), "image/png")
    second = data_url(image_bytes(48, 64, seed=2), "image/png")
    async with serving(engine_process) as (client, models):
        cards = (await client.get("/v1/models")).json()["data"]
        assert [c["scores"] for c in cards if c["id"] == NAME] == [True]
        count = tower_counter(models, engine_process)
        await chat(client, first)
        assert await settled(count, 1) == 1
        results = await rerank(client, first)  # the image chat encoded: not encoded again
        assert sorted(r["index"] for r in results) == [0, 1]
        assert await settled(count, 2, timeout=1.0) == 1
        await rerank(client, second)
        assert await settled(count, 2) == 2
        await chat(client, second)  # the image rerank encoded: not encoded again
        assert await settled(count, 3, timeout=1.0) == 2


async def test_a_gateway_entry_with_both_roles_relays_chat_and_rerank() -> None:
    from vlmserve.registry.build import entry_handle
    from vlmserve.registry.entries import ModelEntry

    async with serving(engine_process=False) as (worker, _):
        config = {"base_url": str(worker.base_url), "preflight": False}
        entry = ModelEntry(
            name=NAME, backend="openai", roles=["chat", "rerank"], backend_config=config
        )
        settings = Settings(device="cpu", upstream_health_interval=0)
        gateway = ModelManager([entry_handle(entry, settings)])
        app = build_app(settings, models=gateway)
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=120
                ) as client,
            ):
                image = data_url(image_bytes(32, 32, seed=4), "image/png")
                await chat(client, image)
                assert len(await rerank(client, image)) == 2
                cards = (await client.get("/v1/models")).json()["data"]
        finally:
            await gateway.aclose()
    assert [c["scores"] for c in cards if c["id"] == NAME] == [True]
