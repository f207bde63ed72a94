"""Bounds checked before work, in-process on the tiny Qwen2-VL: media references counted and
sized before a byte of a file is read, each distinct file read once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import image_bytes


@contextlib.asynccontextmanager
async def serving(tiny_dir: Path, models: ModelManager, **settings: Any
                  ) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:  # fmt: skip
    app = build_app(make_settings(tiny_dir, **settings), models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield app, c


async def upload(http: httpx.AsyncClient, data: bytes, purpose: str, name: str = "f") -> str:
    answer = await http.post("/v1/files", files={"file": (name, data)},
                             data={"purpose": purpose})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def image_refs(*file_ids: str) -> dict[str, Any]:
    parts = [{"type": "input_image", "file_id": f} for f in file_ids]
    content = [*parts, {"type": "input_text", "text": "Describe."}]
    return {"model": MODEL, "max_output_tokens": 2, "store": False,
            "input": [{"role": "user", "content": content}]}  # fmt: skip


async def test_a_file_named_three_times_is_read_once(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        file_id = await upload(http, image_bytes(16, 16), "vision", "a.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(file_id, file_id, file_id))
    assert answer.status_code == 200, answer.text
    assert reads == [file_id]


async def test_a_file_over_the_media_limit_is_refused_by_its_size_before_it_is_read(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path),
                       max_media_bytes=4096) as (app, http):  # fmt: skip
        big = await upload(http, b"\x89PNG\r\n\x1a\n" + bytes(8192), "vision", "big.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(big))
    assert answer.status_code == 413, answer.text
    message = answer.json()["error"]["message"]
    assert big in message and "VLMSERVE_MAX_MEDIA_BYTES" in message
    assert reads == []


async def test_too_many_references_are_refused_before_any_file_is_read(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        file_id = await upload(http, image_bytes(16, 16), "vision", "a.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(*[file_id] * 9))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "too_many_media_items"
    assert "VLMSERVE_MAX_MEDIA_PER_REQUEST" in answer.json()["error"]["message"]
    assert reads == []
