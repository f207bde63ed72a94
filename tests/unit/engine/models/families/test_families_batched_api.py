"""Each batched family through /v1/chat/completions: the stream says what the JSON says.

The app in-process (``httpx.ASGITransport``) serving one tiny family checkpoint on the
continuous-batching engine; an image request (and a text one) streamed and not streamed
concurrently must give the same text (and reasoning, for a thinking model), finish reason
and token count.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.unit.engine.models.families.test_families_batched import ALL_BATCHED

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import FAMILIES
from vlmserve.testing.media import data_url, image_bytes


@pytest.fixture(params=ALL_BATCHED)
async def client(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager]]:
    if request.param == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLMProcessor needs num2words")
    settings = make_settings(FAMILIES[request.param](), max_num_seqs=8)
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            yield c, models
    models.close()


def body(image: bool, stream: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if image:
        url = data_url(image_bytes(64, 48, seed=2), "image/png")
        content.append({"type": "image_url", "image_url": {"url": url}})
    content.append({"type": "text", "text": "What is shown?"})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 20,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }


def streamed(response: httpx.Response) -> tuple[str, str, str | None, int]:
    """SSE body -> (reasoning, text, finish reason, completion tokens)."""
    assert response.status_code == 200, response.text
    reasoning, text, finish, tokens = "", "", None, 0
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        for choice in event.get("choices") or []:
            reasoning += choice["delta"].get("reasoning_content") or ""
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return reasoning, text, finish, tokens


async def test_stream_equals_json_on_the_batching_engine(
    client: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    c, models = client
    assert models.resolve(MODEL).backend.engine is not None  # type: ignore[union-attr]
    for image in (True, False):
        await _stream_and_json_agree(c, image)


async def _stream_and_json_agree(c: httpx.AsyncClient, image: bool) -> None:
    url = "/v1/chat/completions"
    plain, sse = await asyncio.gather(
        c.post(url, json={k: v for k, v in body(image, False).items() if v is not None}),
        c.post(url, json=body(image, True)),
    )
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    reasoning, text, finish, tokens = streamed(sse)
    assert reasoning + text  # Qwen3-VL thinks: its answer so far is all reasoning
    assert text == (choice["message"]["content"] or "")
    assert reasoning == (choice["message"].get("reasoning_content") or "")
    assert finish == choice["finish_reason"] == "length"
    assert tokens == plain.json()["usage"]["completion_tokens"] == 20
