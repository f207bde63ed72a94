"""A model that takes no video (LLaVA-1.5) says so: /v1/models lists what it takes, and a
video request is a 400 naming the model and the missing input, before the video is fetched."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.families import build_family
from vlmserve.testing.media import image_bytes, mp4_bytes


@pytest.fixture(scope="module")
def llava_dir() -> Path:
    return build_family("llava")


@pytest.fixture
async def client(llava_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(llava_dir, served_model_name="llava")
    models = ModelManager.from_settings(settings)
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        await models.load_all()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c", timeout=60) as c:
            yield c
    models.close()


def chat(part: dict[str, Any]) -> dict[str, Any]:
    content = [part, {"type": "text", "text": "What is this?"}]
    return {
        "model": "llava",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
    }


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def test_models_list_what_the_loaded_model_takes(client: httpx.AsyncClient) -> None:
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["capabilities"] == ["vision"]


async def test_a_video_is_refused_naming_the_model_and_the_input(
    client: httpx.AsyncClient,
) -> None:
    video = {"type": "video_url", "video_url": {"url": data_url("video/mp4", mp4_bytes())}}
    response = await client.post("/v1/chat/completions", json=chat(video))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "model_capability_missing"
    assert "'llava'" in error["message"] and "video" in error["message"]
    unreachable = {"type": "video_url", "video_url": {"url": "http://192.0.2.1/clip.mp4"}}
    refused = await client.post("/v1/chat/completions", json=chat(unreachable))
    assert refused.json()["error"]["code"] == "model_capability_missing"  # before any fetch


async def test_an_image_is_answered(client: httpx.AsyncClient) -> None:
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", image_bytes())}}
    response = await client.post("/v1/chat/completions", json=chat(image))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
