"""Continuous batching seen through /v1/chat/completions (in-process app, tiny Qwen2-VL)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes


def chat(text: str, media: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [media] if media else []
    content.append({"type": "text", "text": text})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    return {**body, **extra}


def image(w: int, h: int, seed: int = 0) -> dict[str, Any]:
    url = data_url(image_bytes(w, h, seed=seed), "image/png")
    return {"type": "image_url", "image_url": {"url": url}}


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def test_concurrent_requests_get_the_answers_they_get_alone(
    client: httpx.AsyncClient, chat_models: ModelManager
) -> None:
    video = {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(4), "video/mp4")}}
    bodies = [
        chat("Describe the image.", image(64, 48), max_tokens=30),
        chat("A longer text-only question about many things " * 3, max_tokens=20),
        chat("And this one?", image(90, 120, seed=4), max_tokens=26),
        chat("What happens in the clip?", video, max_tokens=22),
        chat("Short", max_tokens=34),
        chat("Same picture again", image(64, 48), max_tokens=18),
        chat("Sampled", temperature=1.0, seed=77, max_tokens=28),
        chat("Text", max_tokens=16),
    ]
    alone = [answer(await client.post("/v1/chat/completions", json=b)) for b in bodies]
    engine = chat_models.resolve(MODEL).backend.engine  # type: ignore[union-attr]
    engine.peak_running = 0
    together = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [answer(r) for r in together] == alone
    assert engine.peak_running >= 4  # they really shared decode steps


@pytest.fixture
async def one_row_client(tiny_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, HFChatBackend]]:
    """An app whose model decodes one request at a time and queues at most one more."""
    settings = make_settings(tiny_dir, max_num_seqs=1, max_queued_requests=1)
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            yield c, models.resolve(MODEL).backend  # type: ignore[misc]
    models.close()


async def _fill_queue(
    client: httpx.AsyncClient, backend: HFChatBackend
) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """One request decoding (long), one waiting: the one-row engine's queue is full."""
    engine = backend.engine
    assert engine is not None
    post = client.post
    running = asyncio.create_task(post("/v1/chat/completions", json=chat("Long", max_tokens=3000)))
    await _until(lambda: engine.gauges.running == 1 and engine.tokens_generated > 0)
    queued = asyncio.create_task(post("/v1/chat/completions", json=chat("Next", max_tokens=5)))
    await _until(lambda: engine.gauges.queued == 1)
    return running, queued


async def _free_row(running: asyncio.Task[Any]) -> None:
    running.cancel()  # the client goes away: its row frees, the queued request runs
    with contextlib.suppress(asyncio.CancelledError):
        await running


async def test_a_full_queue_is_a_429_in_the_openai_shape_then_drains(
    one_row_client: tuple[httpx.AsyncClient, HFChatBackend],
) -> None:
    client, backend = one_row_client
    running, queued = await _fill_queue(client, backend)
    refused = await client.post("/v1/chat/completions", json=chat("Too many", max_tokens=5))
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "VLMSERVE_MAX_QUEUED_REQUESTS" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    await _free_row(running)
    drained = await asyncio.wait_for(queued, 30)
    assert drained.status_code == 200, drained.text
    assert drained.json()["usage"]["completion_tokens"] == 5


async def test_a_stream_refused_by_a_full_queue_is_an_http_429_not_a_200(
    one_row_client: tuple[httpx.AsyncClient, HFChatBackend],
) -> None:
    client, backend = one_row_client
    running, queued = await _fill_queue(client, backend)
    body = chat("Too many", max_tokens=5, stream=True)
    refused = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert backend.in_flight == 2  # the refused stream never reached the engine
    await _free_row(running)
    assert (await asyncio.wait_for(queued, 30)).status_code == 200


async def _until(condition: Any, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.002)
