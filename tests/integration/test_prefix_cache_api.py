"""Prefix caching through the app: ``enable_prefix_caching`` (``--enable-prefix-caching``),
server-wide or per ``[[models]]`` table.

A second question under the same long system prompt is answered as without the cache, and
``/metrics`` counts the prompt tokens looked up and found (vLLM's ``prefix_cache_queries`` and
``prefix_cache_hits``). A ``[[models]]`` table's own ``kv_cache_memory`` and
``enable_prefix_caching`` reach that model's engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from support import MODEL, make_settings
from upstreams import serve_asgi
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.registry.manager import ModelHandle, ModelManager

SYSTEM = "You extract the fields of identity cards and answer in one short line. " * 6


def chat(question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "temperature": 0,
        "max_tokens": 12,
    }


@asynccontextmanager
async def serving(settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager]]:
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                yield c, models
    finally:
        models.close()


def counter(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(f"{name}{{")]
    assert lines, f"{name} is not in /metrics"
    return float(lines[0].split()[-1])


async def test_a_shared_system_prompt_is_found_in_the_cache_and_counted(tiny_dir: Path) -> None:
    questions = ["Name?", "Date of birth?", "Card number?"]
    async with serving(make_settings(tiny_dir, enable_prefix_caching=False)) as (uncached, _):
        plain = [
            (await uncached.post("/v1/chat/completions", json=chat(q))).json() for q in questions
        ]
    settings = make_settings(tiny_dir, enable_prefix_caching=True)
    async with serving(settings) as (cached, _):
        answers = [await cached.post("/v1/chat/completions", json=chat(q)) for q in questions]
        metrics = (await cached.get("/metrics")).text
    assert all(a.status_code == 200 for a in answers)
    assert [a.json()["choices"] for a in answers] == [p["choices"] for p in plain]
    assert "prompt_tokens_details" not in plain[0]["usage"]  # a model that caches nothing
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and cached[1] >= 5 * 16 and cached[2] >= 5 * 16
    prompts = sum(a.json()["usage"]["prompt_tokens"] for a in answers)
    assert counter(metrics, "vlmserve_prefix_cache_queries_total") == prompts
    assert counter(metrics, "vlmserve_prefix_cache_hits_total") == sum(cached)


async def test_a_stream_and_a_response_report_the_cached_tokens(tiny_dir: Path) -> None:
    settings = make_settings(tiny_dir, enable_prefix_caching=True)
    async with serving(settings) as (cached, _):
        await cached.post("/v1/chat/completions", json=chat("Name?"))
        body = {**chat("Number?"), "stream": True, "stream_options": {"include_usage": True}}
        async with cached.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 5 * 16
        response = await cached.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "instructions": SYSTEM,
                "input": "Date?",
                "max_output_tokens": 8,
            },
        )
        details = response.json()["usage"]["input_tokens_details"]
        assert details["cached_tokens"] >= 5 * 16, response.json()["usage"]


async def test_a_models_table_sets_its_own_budget_and_prefix_caching(tiny_dir: Path) -> None:
    table = ModelConfig(
        name=MODEL, source=str(tiny_dir), kv_cache_memory="3MiB", enable_prefix_caching=True
    )
    settings = make_settings(tiny_dir, model=None, served_model_name=None, models=[table])
    async with serving(settings) as (cached, models):
        engine = models.resolve(MODEL).backend.engine  # type: ignore[attr-defined]
        assert engine.kv.budget == 3 * 2**20 and engine.blocks.prefix_caching
        for question in ("Name?", "Name again?"):
            answer = await cached.post("/v1/chat/completions", json=chat(question))
            assert answer.status_code == 200, answer.text
        assert engine.scheduler.prefix_hits > 0


async def test_a_cache_salt_shares_cached_blocks_only_within_its_tenant(tiny_dir: Path) -> None:
    """vLLM's ``cache_salt``: the same system prompt under another salt is computed again; a
    Responses request takes the same field."""
    tenant_a, tenant_b = "a" * 43, "b" * 43  # 256-bit salts, base64-sized

    async def cached_tokens(client: httpx.AsyncClient, question: str, salt: str) -> int:
        r = await client.post("/v1/chat/completions", json={**chat(question), "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    settings = make_settings(tiny_dir, enable_prefix_caching=True)
    async with serving(settings) as (cached, _):
        assert await cached_tokens(cached, "Name?", tenant_a) == 0
        assert await cached_tokens(cached, "Date of birth?", tenant_b) == 0
        assert await cached_tokens(cached, "Card number?", tenant_a) >= 5 * 16
        ask = {"model": MODEL, "instructions": SYSTEM, "input": "Date?", "max_output_tokens": 4}
        other = await cached.post("/v1/responses", json={**ask, "cache_salt": "c" * 43})
        same = await cached.post("/v1/responses", json={**ask, "cache_salt": tenant_b})
        assert other.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert same.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 5 * 16
        empty = await cached.post("/v1/chat/completions", json={**chat("Name?"), "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


async def test_the_gateway_passes_an_upstreams_cached_tokens_on(tiny_dir: Path) -> None:
    """A proxied model's usage keeps the worker's ``prompt_tokens_details``."""
    worker_settings = make_settings(tiny_dir, enable_prefix_caching=True)
    async with serving(worker_settings) as (_, worker_models):
        worker = build_app(worker_settings, models=worker_models)
        async with serve_asgi(worker) as url:
            config = UpstreamConfig(model=MODEL, base_urls=[url], health_interval=0)
            gateway_models = ModelManager(
                [ModelHandle("gw", ["chat"], UpstreamBackend("gw", config))]
            )
            gateway = build_app(Settings(device="cpu"), models=gateway_models)
            async with gateway.router.lifespan_context(gateway):
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://gw", timeout=60
                ) as client:
                    first = await client.post(
                        "/v1/chat/completions", json={**chat("Name?"), "model": "gw"}
                    )
                    again = await client.post(
                        "/v1/chat/completions", json={**chat("Date?"), "model": "gw"}
                    )
            await gateway_models.aclose()
    assert first.status_code == again.status_code == 200, again.text
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * 16
