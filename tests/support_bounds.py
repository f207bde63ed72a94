"""Helpers of the bounds tests: the app in-process with its lifespan, uploads, batches."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager


@contextlib.asynccontextmanager
async def serving(
    tiny_dir: Path, models: ModelManager, **settings: Any
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = build_app(make_settings(tiny_dir, **settings), models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield app, c


async def upload(http: httpx.AsyncClient, data: bytes, purpose: str, name: str = "f") -> str:
    answer = await http.post("/v1/files", files={"file": (name, data)}, data={"purpose": purpose})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def image_refs(*file_ids: str) -> dict[str, Any]:
    parts = [{"type": "input_image", "file_id": f} for f in file_ids]
    content = [*parts, {"type": "input_text", "text": "Describe."}]
    return {
        "model": MODEL,
        "max_output_tokens": 2,
        "store": False,
        "input": [{"role": "user", "content": content}],
    }


def chat_line(custom_id: str, text: str = "Hi.", **body: Any) -> dict[str, Any]:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        **body,
    }
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": request,
    }


async def run_batch(http: httpx.AsyncClient, data: bytes) -> dict[str, Any]:
    file_id = await upload(http, data, "batch", "in.jsonl")
    made = await http.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    )
    assert made.status_code == 200, made.text
    return await finished(http, made.json()["id"])


async def finished(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    for _ in range(6000):
        batch = (await http.get(f"/v1/batches/{batch_id}")).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch stuck in {batch['status']}")
