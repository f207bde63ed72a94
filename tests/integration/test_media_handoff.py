"""A media worker's pixels handed to the engine process in the worker's own shared memory
block, through the app with a real engine process (``python -m vlmserve.engine.proc``) on
the tiny Qwen2-VL: greedy answers and token counts with two media workers are those with
none; the API process copies no pixels into blocks of its own; and no block outlives its
request, whether it was answered, refused by the engine, or cancelled at any point."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.api.common.convert import Converter
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.engine.proc import pixels
from vlmserve.media.workers import MediaPool
from vlmserve.media.workers.shared import SharedImage
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes

PHOTO = (203, 151)  # a size no other test's image has: its blocks are found by size
OTHER = (211, 149)  # the refused request's
CONTEXT = 120  # tokens: the image and clip (~94) fit, with 60 more words they do not


def _blocks(size: tuple[int, int]) -> set[str]:
    """Shared memory blocks holding an RGB image of ``size`` (a worker's or one made for
    the engine process)."""
    names = set()
    for name in os.listdir("/dev/shm"):
        with contextlib.suppress(OSError):
            ours = name.startswith(("psm_", "vlmserve_px_"))
            if ours and os.stat(f"/dev/shm/{name}").st_size == size[0] * size[1] * 3:
                names.add(name)
    return names


def _body(
    size: tuple[int, int] = PHOTO, max_tokens: int = 8, text: str = "Describe both."
) -> dict[str, Any]:
    photo = data_url(image_bytes(*size, fmt="JPEG", seed=5), "image/jpeg")
    clip = data_url(mp4_bytes(frames=6, seed=2), "video/mp4")
    content = [
        {"type": "image_url", "image_url": {"url": photo}},
        {"type": "video_url", "video_url": {"url": clip}},
        {"type": "text", "text": text},
    ]
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


@asynccontextmanager
async def serving(
    tiny_dir: Path, workers: int, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager]]:
    config = make_settings(tiny_dir, engine_process=True, media_workers=workers, **settings)
    models = ModelManager.from_settings(config)
    for handle in models.handles:
        await handle.backend.aload()
    app = build_app(config, models=models)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://vlmserve.test", timeout=120
            ) as client:
                yield client, models
    finally:
        await models.aclose()


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The blocks the API process wrote pixels into for the engine process."""
    names: list[str] = []
    put = pixels._put

    def recorded(image: Image.Image) -> SharedImage:
        shared = put(image)
        names.append(shared.name)
        return shared

    monkeypatch.setattr(pixels, "_put", recorded)
    return names


async def _answer(client: httpx.AsyncClient) -> tuple[str, int]:
    answer = await client.post("/v1/chat/completions", json=_body())
    assert answer.status_code == 200, answer.text
    body = {"model": MODEL, "messages": _body()["messages"]}
    counted = (await client.post("/tokenize", json=body)).json()["count"]
    return answer.json()["choices"][0]["message"]["content"], counted


async def test_greedy_answers_with_two_media_workers_equal_those_with_none_and_no_copy(
    tiny_dir: Path, made: list[str]
) -> None:
    before = _blocks(PHOTO)
    async with serving(tiny_dir, 0) as (client, _):
        local = await _answer(client)
    assert made  # without workers the API process writes the engine's blocks
    made.clear()
    async with serving(tiny_dir, 2) as (client, _):
        pooled = await _answer(client)
        assert made == []  # with workers it hands over theirs: no copy of its own
        assert _blocks(PHOTO) == before  # answered: the blocks are gone
    assert pooled == local


async def test_no_block_outlives_a_refused_or_cancelled_request(tiny_dir: Path) -> None:
    before, before_other = _blocks(PHOTO), _blocks(OTHER)
    async with serving(tiny_dir, 2, max_model_len=CONTEXT) as (client, models):
        long = _body(OTHER, text="word " * 60)
        refused = await client.post("/v1/chat/completions", json=long)
        assert refused.status_code == 400, refused.text  # by the engine, after the decode
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert _blocks(OTHER) == before_other
        backend = models.resolve(MODEL).backend
        pool = MediaPool(1, nice=0)
        converter = Converter.from_settings(make_settings(tiny_dir), pool=pool)
        try:
            for delay in (0.0, 0.002, 0.01, 0.03, 0.1, 0.3):
                await _cancelled(converter, backend, delay)
            await asyncio.sleep(0.5)  # an abandoned decode finishes in its worker, then goes
        finally:
            pool.close()
        assert _blocks(PHOTO) == before and _blocks(OTHER) == before_other
        again = await client.post("/v1/chat/completions", json=_body(max_tokens=2))
        assert again.status_code == 200, again.text


async def _cancelled(converter: Converter, backend: Any, delay: float) -> None:
    """A request cancelled ``delay`` s into its way: while its media are decoded, while
    they are handed over, or while the engine process prepares it."""
    wire = ChatCompletionRequest.model_validate(_body())

    async def decode_and_prepare() -> Any:
        sampling = backend.video_sampling()
        request = await converter.to_request(wire, "cancelled", sampling=sampling)
        return await backend.prepare(request)

    task = asyncio.ensure_future(decode_and_prepare())
    await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await backend.discard(await task)  # it was done before the cancel
