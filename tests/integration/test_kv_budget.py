"""The KV cache budget through the app: ``kv_cache_memory`` (``--kv-cache-memory``).

With a budget of about four sequences, 32 concurrent 128-token image streams all finish
with 200 and exactly the text each gives alone, the engine preempting on the way, and the
process's resident memory grows by at most the budget + 256 MiB meanwhile; a request that
could never fit is a 400 that names the budget and the setting, before any work.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoConfig

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes

TOKENS = 128
BLOCK = 16
SLACK = 256 * 2**20  # what the issue allows over the budget (buffers, media, Python objects)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident memory every 5 ms while in the block."""

    def __init__(self) -> None:
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def body(i: int, max_tokens: int = TOKENS, **extra: Any) -> dict[str, Any]:
    url = data_url(image_bytes(48 + 8 * (i % 4), 48, seed=i), "image/png")
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": f"Describe picture {i}."},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def block_bytes(tiny_dir: Path) -> int:
    text = AutoConfig.from_pretrained(tiny_dir).get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * BLOCK * 4


async def stream_text(client: httpx.AsyncClient, payload: dict[str, Any]) -> str:
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
    return text


@pytest.fixture
async def tight(tiny_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager, int]]:
    """An app whose model's KV budget holds about four of these requests."""
    per_seq = -(-(120 + TOKENS) // BLOCK)  # these prompts take < 120 tokens
    budget = (4 * per_seq + 1) * block_bytes(tiny_dir)
    settings = make_settings(
        tiny_dir, kv_cache_memory=budget, max_num_seqs=32, max_queued_requests=64
    )
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=300) as c:
            yield c, models, budget
    models.close()


async def test_32_image_streams_in_a_budget_of_4_all_finish_as_alone(
    client: httpx.AsyncClient, tight: tuple[httpx.AsyncClient, ModelManager, int]
) -> None:
    small, models, budget = tight
    bodies = [body(i) for i in range(32)]
    first = await client.post("/v1/chat/completions", json=bodies[0])
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] < 120
    alone = [await stream_text(client, b) for b in bodies]  # the ample default budget
    engine = models.resolve(MODEL).backend.engine  # type: ignore[union-attr]
    assert engine.gauges.kv_cache_bytes <= budget
    with PeakRSS() as memory:
        together = await asyncio.gather(*(stream_text(small, b) for b in bodies))
    assert together == alone
    assert memory.peak - memory.start <= budget + SLACK
    assert engine.gauges.preemptions > 0
    assert engine.gauges.kv_usage == 0.0
    metrics = (await small.get("/metrics")).text
    counted = [
        line for line in metrics.splitlines() if line.startswith("vlmserve_num_preemptions_total{")
    ]
    assert counted and float(counted[0].split()[-1]) == engine.gauges.preemptions


async def test_a_request_larger_than_the_whole_budget_is_a_400_naming_it(
    tight: tuple[httpx.AsyncClient, ModelManager, int],
) -> None:
    small, models, budget = tight
    engine = models.resolve(MODEL).backend.engine  # type: ignore[union-attr]
    steps = engine.steps
    r = await small.post("/v1/chat/completions", json=body(0, max_tokens=4 * 4 * TOKENS))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"{budget / 2**20:.1f} MiB" in message
    assert "--kv-cache-memory" in message and "VLMSERVE_KV_CACHE_MEMORY" in message
    assert engine.steps == steps  # refused before any work
