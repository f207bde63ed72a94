"""A server built from a registry file: aliases, served ids, roles, deprecation, capabilities."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, mp4_bytes


def registry_file(tmp_path: Path, tiny_dir: Path) -> Path:
    path = tmp_path / "registry.toml"
    path.write_text(f'''
[[models]]
name = "old"
source = "{tiny_dir}"
roles = ["chat"]
deprecated = true

[[models]]
name = "chat-a"
source = "{tiny_dir}"
served_model_id = "tiny-chat"
model_aliases = ["alias-a"]
roles = ["chat", "caption"]

[models.capabilities]
vision = true
video = false
''')
    return path


@pytest.fixture
async def client(tmp_path: Path, tiny_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        registry=str(registry_file(tmp_path, tiny_dir)), device="cpu", engine_process=False
    )
    models = ModelManager.from_settings(settings)
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        await models.load_all()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r", timeout=60) as c:
            yield c
    models.close()


def chat(model: str, content: Any = "hi") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
    }


@pytest.mark.parametrize(
    ("asked", "served"),
    [
        ("alias-a", "tiny-chat"),
        ("tiny-chat", "tiny-chat"),
        ("chat-a", "tiny-chat"),
        ("role:chat", "tiny-chat"),
        ("old", "old"),
    ],
)
async def test_resolution_by_alias_served_id_role_and_deprecated_name(
    client: httpx.AsyncClient, asked: str, served: str
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(asked))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == served


async def test_models_list_shows_served_ids(client: httpx.AsyncClient) -> None:
    ids = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
    assert ids == {"old", "tiny-chat"}


async def test_a_missing_capability_is_400_before_any_work(client: httpx.AsyncClient) -> None:
    video = data_url(mp4_bytes(frames=4), "video/mp4")
    content = [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": "?"}]
    r = await client.post("/v1/chat/completions", json=chat("tiny-chat", content))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "model_capability_missing" and "video" in error["message"]
    unknown = await client.post("/v1/chat/completions", json=chat("gpt-9"))
    assert unknown.status_code == 404 and "tiny-chat" in unknown.json()["error"]["message"]
