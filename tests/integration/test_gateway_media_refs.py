"""Media by ``uuid`` through a gateway of two workers: the ``uuid`` goes back to the replica
that kept it, and stays the client key's own although the workers see the gateway's key."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import MODEL, make_settings
from upstreams import serve_asgi
from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.registry.manager import ModelHandle, ModelManager
from vlmserve.testing.media import data_url, image_bytes

URL = data_url(image_bytes(64, 48), "image/png")
KEYS = {"a": {"Authorization": "Bearer key-a"}, "b": {"Authorization": "Bearer key-b"}}


@pytest.fixture
async def gateway(tiny_dir: Path, chat_models: ModelManager) -> AsyncIterator[httpx.AsyncClient]:
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for _ in range(2):  # two workers, each with its own media store
            worker = build_app(make_settings(tiny_dir), models=chat_models)
            urls.append(await stack.enter_async_context(serve_asgi(worker)))
        config = UpstreamConfig(model=MODEL, base_urls=urls, health_interval=0, policy=PoolPolicy())
        models = ModelManager([ModelHandle("gw", ["chat"], UpstreamBackend("gw", config))])
        settings = Settings(device="cpu", api_keys=["key-a", "key-b"])
        app = build_app(settings, models=models)
        await stack.enter_async_context(app.router.lifespan_context(app))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60
        )
        yield await stack.enter_async_context(client)
        await models.aclose()


def chat(image_url: Any, stream: bool = False) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": image_url, "uuid": "photo-1"}
    content = [part, {"type": "text", "text": "Describe."}]
    return {
        "model": "gw",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": stream,
    }


async def test_a_uuid_alone_reaches_the_replica_that_kept_it(gateway: httpx.AsyncClient) -> None:
    first = await gateway.post("/v1/chat/completions", json=chat({"url": URL}), headers=KEYS["a"])
    assert first.status_code == 200, first.text
    for stream in (False, True, False, True):  # least-outstanding alone would alternate
        r = await gateway.post(
            "/v1/chat/completions", json=chat(None, stream=stream), headers=KEYS["a"]
        )
        assert r.status_code == 200, r.text


async def test_another_keys_uuid_is_unknown_through_the_gateway(
    gateway: httpx.AsyncClient,
) -> None:
    sent = await gateway.post("/v1/chat/completions", json=chat({"url": URL}), headers=KEYS["a"])
    assert sent.status_code == 200, sent.text
    r = await gateway.post("/v1/chat/completions", json=chat(None), headers=KEYS["b"])
    assert r.status_code == 400, r.text
    assert "send the data again" in r.json()["error"]["message"]
