"""Concurrent ``HFEmbedBackend.embed`` calls share forward passes (tiny Qwen2-VL + LoRA, no mocks).

Forward passes are counted with ``backend.forward_passes``; where a test needs each pass's
size it wraps ``_embed_batch`` with a spy that records ``len(items)`` and calls through.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.hf.embed import EmbedInput, HFEmbedBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.hf.score.backend import HFRerankBackend
from vlmserve.errors import ConfigError, InvalidRequest, ServiceUnavailable
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_lora_adapter
from vlmserve.testing.media import gradient_image, image_bytes

EMBED = "tiny-vlm2vec"


def frames(n: int, seed: int = 0) -> list[Image.Image]:
    return [gradient_image(56, 56, seed=seed * 100 + i) for i in range(n)]


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir: Path) -> Path:
    return build_lora_adapter(tiny_dir)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path, adapter_dir: Path) -> Iterator[HFEmbedBackend]:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    backend = HFEmbedBackend("tiny-embed", options, adapter=str(adapter_dir))
    backend.load()
    yield backend
    backend.close()


@pytest.fixture
def embedder(loaded: HFEmbedBackend) -> Iterator[HFEmbedBackend]:
    """The loaded backend with its defaults (max_batch 16, 5 ms) restored after each test."""
    yield loaded
    loaded.max_batch, loaded.batch_wait_ms = 16, 5.0


@pytest.fixture
def sizes(embedder: HFEmbedBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of items in every forward pass from now on (the real pass still runs)."""
    seen: list[int] = []
    real = embedder._embed_batch

    def spy(loaded: Any, items: list[EmbedInput]) -> np.ndarray:
        seen.append(len(items))
        return real(loaded, items)

    monkeypatch.setattr(embedder, "_embed_batch", spy)
    return seen


def alone(backend: HFEmbedBackend, items: list[EmbedInput]) -> np.ndarray:
    """Each item embedded in a forward pass of its own: [len(items), dim]."""
    return np.stack([backend.embed_sync([item])[0] for item in items])


def mixed_requests() -> list[list[EmbedInput]]:
    """Eight requests shaped like /encode-text, /encode-video and /v1/embeddings bodies."""
    return [
        [EmbedInput(text="a red car")],
        [EmbedInput(frames=frames(4, seed=1))],
        [EmbedInput(text="a much longer query about a gradient drifting to the left " * 3)],
        [EmbedInput(text="first of two"), EmbedInput(text="second of two, a bit longer")],
        [EmbedInput(frames=frames(2, seed=2))],
        [EmbedInput(image=gradient_image(84, 56, seed=3))],
        [EmbedInput(text="which colour moves?", frames=frames(6, seed=4))],
        [EmbedInput(text="dog")],
    ]


# --- gathering ---------------------------------------------------------------------------
async def test_eight_concurrent_mixed_requests_share_one_forward_and_match_alone(embedder):
    requests = mixed_requests()
    expected = [alone(embedder, items) for items in requests]
    before = embedder.forward_passes
    results = await asyncio.gather(*(embedder.embed(items) for items in requests))
    assert embedder.forward_passes - before == 1  # 9 items <= max_batch 16: one pass
    for got, want in zip(results, expected, strict=True):
        assert got.shape == want.shape  # each request gets exactly its own rows, in order
        assert np.abs(got - want).max() < 1e-5


async def test_requests_arriving_within_the_wait_join_the_same_forward(embedder):
    embedder.batch_wait_ms = 400
    items = [EmbedInput(text=f"query number {i}") for i in range(3)]
    before = embedder.forward_passes
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(embedder.embed([item])))
        await asyncio.sleep(0.02)  # arrive one after another, well inside the 400 ms wait
    results = await asyncio.gather(*tasks)
    assert embedder.forward_passes - before == 1
    np.testing.assert_allclose(np.concatenate(results), alone(embedder, items), atol=1e-5)


async def test_a_full_batch_runs_at_once_without_waiting_out_the_window(embedder, sizes):
    embedder.max_batch, embedder.batch_wait_ms = 2, 60_000  # a minute: the test would time out
    items = [EmbedInput(text="one"), EmbedInput(text="two")]
    results = await asyncio.wait_for(
        asyncio.gather(*(embedder.embed([item]) for item in items)), timeout=30
    )
    assert sizes == [2]
    np.testing.assert_allclose(np.concatenate(results), alone(embedder, items), atol=1e-5)


async def test_zero_wait_still_batches_what_is_pending(embedder):
    embedder.batch_wait_ms = 0
    items = [EmbedInput(text=f"text {i}") for i in range(4)]
    before = embedder.forward_passes
    results = await asyncio.gather(*(embedder.embed([item]) for item in items))
    assert embedder.forward_passes - before == 1
    np.testing.assert_allclose(np.concatenate(results), alone(embedder, items), atol=1e-5)


async def test_max_batch_caps_every_forward_pass(embedder, sizes):
    embedder.max_batch = 3
    requests = [[EmbedInput(text=f"short {i}")] for i in range(7)]
    requests.append([EmbedInput(text=f"part {i} of a bigger request") for i in range(4)])
    expected = [alone(embedder, items) for items in requests]
    sizes.clear()
    results = await asyncio.gather(*(embedder.embed(items) for items in requests))
    assert sizes == [3, 3, 3, 2]  # the 4-item request shares the third pass and fills a fourth
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


# --- one request's trouble stays its own -------------------------------------------------
async def test_a_request_that_breaks_the_batch_fails_alone(embedder):
    good = [[EmbedInput(text="a red car")], [EmbedInput(frames=frames(2))], [EmbedInput(text="x")]]
    bad = [EmbedInput(image=Image.new("RGB", (400, 2)))]  # passes checks, fails preprocessing
    requests = [good[0], bad, good[1], good[2]]
    results = await asyncio.gather(*(embedder.embed(r) for r in requests), return_exceptions=True)
    assert isinstance(results[1], InvalidRequest) and "aspect ratio" in str(results[1])
    for got, items in zip([results[0], results[2], results[3]], good, strict=True):
        assert isinstance(got, np.ndarray), got
        np.testing.assert_allclose(got, alone(embedder, items), atol=1e-5)


async def test_an_invalid_request_is_refused_before_it_joins_a_batch(embedder, sizes):
    requests = [[EmbedInput(text="fine")], [EmbedInput(text="   ")], [EmbedInput(text="also")]]
    results = await asyncio.gather(*(embedder.embed(r) for r in requests), return_exceptions=True)
    assert isinstance(results[1], InvalidRequest) and "input[0] has empty text" in str(results[1])
    assert isinstance(results[0], np.ndarray) and isinstance(results[2], np.ndarray)
    assert sizes == [2]  # the bad request never reached the model


async def test_a_cancelled_waiter_leaves_the_batch_before_the_forward(embedder, sizes):
    embedder.batch_wait_ms = 300
    items = [EmbedInput(text="stays"), EmbedInput(frames=frames(2)), EmbedInput(text="leaves")]
    tasks = [asyncio.create_task(embedder.embed([item])) for item in items]
    await asyncio.sleep(0.05)
    tasks[2].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    assert sizes == [2]  # the cancelled item was not embedded
    np.testing.assert_allclose(np.concatenate(done[:2]), alone(embedder, items[:2]), atol=1e-5)


async def test_cancelling_a_request_while_its_forward_runs_does_not_break_the_others(embedder):
    embedder.batch_wait_ms = 0
    items = [EmbedInput(frames=frames(8, seed=5)), EmbedInput(frames=frames(8, seed=6))]
    before = embedder.forward_passes
    tasks = [asyncio.create_task(embedder.embed([item])) for item in items]
    while embedder.forward_passes == before:  # the shared forward has started on the thread
        await asyncio.sleep(0.001)
    tasks[0].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    np.testing.assert_allclose(done[1], alone(embedder, items[1:]), atol=1e-5)
    again = await embedder.embed([EmbedInput(text="the batcher still works")])
    assert again.shape == (1, embedder.dim)


async def test_an_unloaded_backend_is_unavailable_without_queueing(tiny_dir):
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    with pytest.raises(ServiceUnavailable, match="unloaded"):
        await HFEmbedBackend("cold", options).embed([EmbedInput(text="x")])


@pytest.mark.parametrize("backend", [HFEmbedBackend, HFRerankBackend])
def test_a_batch_size_below_one_is_refused_naming_the_model(
    tiny_dir: Path, backend: type[HFEmbedBackend | HFRerankBackend]
) -> None:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="max_batch is 0 for 'tiny'; it must be at least 1"):
        backend("tiny", options, max_batch=0)


# --- through the HTTP API ----------------------------------------------------------------
@pytest.fixture(scope="module")
def embed_models(tiny_dir: Path, adapter_dir: Path) -> Iterator[ModelManager]:
    cfg = ModelConfig(
        name=EMBED, source=str(tiny_dir), adapter=str(adapter_dir), roles=["embedding"]
    )
    handle = hf_handle(cfg, Settings(device="cpu", embed_batch_wait_ms=200))
    handle.backend.load()
    yield ModelManager([handle])
    handle.backend.close()


async def test_concurrent_encode_and_embeddings_requests_share_forward_passes(
    tiny_dir: Path, embed_models: ModelManager
) -> None:
    backend = embed_models.resolve(EMBED).backend
    jpegs = [base64.b64encode(image_bytes(56, 56, "JPEG", seed=i)).decode() for i in range(2)]
    calls = [
        ("/encode-text", {"text": "a dog on a beach"}),
        ("/encode-video", {"frames": jpegs}),
        ("/v1/embeddings", {"model": EMBED, "input": ["red car", "blue boat"]}),
        ("/encode-text", {"text": "a cat"}),
        ("/encode-text", {"text": ""}),  # a 400 for this one only
        ("/encode-video", {"frames": jpegs[:1]}),
    ]
    app = build_app(make_settings(tiny_dir), models=embed_models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=120) as c:
            before = backend.forward_passes
            replies = await asyncio.gather(*(c.post(path, json=body) for path, body in calls))
            passes = backend.forward_passes - before
            single = await c.post("/encode-text", json={"text": "a cat"})
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 400, 200]
    assert replies[4].json()["error"]["message"]
    assert passes < 5  # five good requests, fewer forward passes
    vectors = replies[2].json()["data"]
    assert [v["index"] for v in vectors] == [0, 1]
    assert np.allclose(replies[3].json()["embedding"], single.json()["embedding"], atol=1e-5)
