"""Seed 000's worker API and /v1/embeddings: two models in one server, picked by role."""

from __future__ import annotations

import base64
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from support import MODEL, LiveServer, make_settings
from vlmserve.api.app import build_app
from vlmserve.api.endpoints.worker.service import caption_messages
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import LifecyclePolicy, ModelHandle, ModelManager
from vlmserve.testing import build_lora_adapter
from vlmserve.testing.media import data_url, gradient_image, image_bytes

EMBED = "tiny-vlm2vec"


def embed_handle(tiny_dir: Path) -> ModelHandle:
    cfg = ModelConfig(
        name=EMBED,
        source=str(tiny_dir),
        adapter=str(build_lora_adapter(tiny_dir)),
        roles=["embedding"],
    )
    return hf_handle(cfg, Settings(device="cpu"))


@pytest.fixture(scope="module")
def two_models(tiny_dir: Path, chat_models: ModelManager) -> Iterator[ModelManager]:
    embedder = embed_handle(tiny_dir)
    embedder.backend.load()
    yield ModelManager([*chat_models.handles, embedder])
    embedder.backend.close()


@pytest.fixture
async def client(tiny_dir: Path, two_models: ModelManager) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(make_settings(tiny_dir), models=two_models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=120) as c:
            yield c


def jpeg_frames(n: int, size: int = 56) -> list[str]:
    return [base64.b64encode(image_bytes(size, size, "JPEG", seed=i)).decode() for i in range(n)]


def unit(vector: list[float]) -> np.ndarray:
    v = np.asarray(vector)
    assert abs(np.linalg.norm(v) - 1.0) < 1e-5
    return v


async def test_encode_text_and_video_return_unit_vectors_of_hidden_size(
    client: httpx.AsyncClient, two_models: ModelManager
) -> None:
    dim = two_models.resolve(EMBED).backend.dim
    text = await client.post("/encode-text", json={"text": "a dog on a beach"})
    video = await client.post("/encode-video", json={"frames": jpeg_frames(4)})
    assert text.status_code == 200 and video.status_code == 200, (text.text, video.text)
    assert len(unit(text.json()["embedding"])) == dim == 128
    assert len(unit(video.json()["embedding"])) == dim
    again = await client.post("/encode-text", json={"text": "a dog on a beach"})
    assert np.allclose(again.json()["embedding"], text.json()["embedding"], atol=1e-6)


async def test_v1_embeddings_agrees_with_encode_text(client: httpx.AsyncClient) -> None:
    texts = ["short", "a much longer query about a red car driving at night"]
    r = await client.post("/v1/embeddings", json={"model": EMBED, "input": texts})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for text, item in zip(texts, data, strict=True):
        single = (await client.post("/encode-text", json={"text": text})).json()["embedding"]
        assert np.allclose(item["embedding"], single, atol=1e-6)  # batched == alone
    assert r.json()["usage"]["prompt_tokens"] > 0


async def test_multimodal_embedding_via_messages(client: httpx.AsyncClient) -> None:
    url = data_url(image_bytes(64, 64), "image/png")
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "cat"}]
    r = await client.post(
        "/v1/embeddings",
        json={"model": EMBED, "messages": [{"role": "user", "content": content}], "dimensions": 16},
    )
    assert r.status_code == 200, r.text
    assert len(unit(r.json()["data"][0]["embedding"])) == 16


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/encode-video", {"frames": []}),
        ("/encode-text", {"text": ""}),
        ("/caption", {"frames": []}),
        ("/encode-text", {"text": "   "}),
    ],
)
async def test_empty_input_is_400(client: httpx.AsyncClient, path: str, payload: dict) -> None:
    r = await client.post(path, json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


async def test_caption_puts_the_transcript_in_the_prompt(
    client: httpx.AsyncClient, two_models: ModelManager
) -> None:
    transcript = "the speaker says: welcome to the harbour"
    backend = two_models.for_role("caption").backend
    frames = [gradient_image(56, 56, seed=i) for i in range(2)]
    prompt = backend.render_prompt(caption_messages(frames, transcript))
    assert transcript in prompt and "<|video_pad|>" in prompt
    assert transcript not in backend.render_prompt(caption_messages(frames, None))
    before = backend.tokens_generated
    r = await client.post("/caption", json={"frames": jpeg_frames(2), "transcript": transcript})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["caption"], str)
    assert backend.tokens_generated - before <= 512
    too_many = await client.post("/caption", json={"frames": jpeg_frames(1), "max_new_tokens": 513})
    assert too_many.status_code == 400


async def test_generate_answers_messages(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "List the entities in: Alice met Bob in Paris."}]
    r = await client.post("/generate", json={"messages": messages, "max_new_tokens": 8})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["text"], str)


async def test_wrong_model_kind_is_400(client: httpx.AsyncClient) -> None:
    chat = {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 400
    emb = await client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert emb.status_code == 400


async def test_encode_is_503_while_the_embedding_model_loads(
    tiny_dir: Path, chat_models: ModelManager
) -> None:
    embedder = embed_handle(tiny_dir)
    gate = threading.Event()
    real_load = embedder.backend.load
    embedder.backend.load = lambda: (gate.wait(30), real_load())  # type: ignore[method-assign]
    models = ModelManager([*chat_models.handles, embedder], LifecyclePolicy(activation_timeout=0.2))
    app = build_app(make_settings(tiny_dir), models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            r = await c.post("/encode-text", json={"text": "hello"})
            gate.set()
    assert r.status_code == 503 and r.headers["retry-after"]
    embedder.backend.close()


def test_openai_client_embeddings(live_server: Any, tiny_dir: Path, two_models: Any) -> None:
    app = build_app(make_settings(tiny_dir), models=two_models)
    with LiveServer(app) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(model=EMBED, input=["red car", "blue boat"])
        short = client.embeddings.create(model=EMBED, input="red car", dimensions=8)
    vectors = [unit(d.embedding) for d in result.data]
    assert len(vectors) == 2 and len(vectors[0]) == 128
    assert len(unit(short.data[0].embedding)) == 8
    assert result.usage.prompt_tokens > 0


async def test_embeddings_of_media_decoded_in_media_workers_equal_those_decoded_here(
    tiny_dir: Path, two_models: ModelManager
) -> None:
    """The embedding model runs in the API process: it reads a media worker's pixels out of
    their shared memory block (``BlockImage``), and gets the very pixels of a local decode."""
    url = data_url(image_bytes(80, 60, "JPEG", seed=3), "image/jpeg")
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "cat"}]
    image = {"model": EMBED, "messages": [{"role": "user", "content": content}]}
    vectors = []
    for workers in (1, 0):
        app = build_app(make_settings(tiny_dir, media_workers=workers), models=two_models)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
                r = await c.post("/v1/embeddings", json=image, timeout=120)
                v = await c.post("/encode-video", json={"frames": jpeg_frames(3)}, timeout=120)
        assert r.status_code == 200 and v.status_code == 200, (r.text, v.text)
        vectors.append((r.json()["data"][0]["embedding"], v.json()["embedding"]))
    assert vectors[0] == vectors[1]
