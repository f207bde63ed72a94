"""What routers and dashboards read from ``/metrics`` while streams decode: running and
waiting per model (also under vLLM's names), slot usage, and streams counted by their route."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import MODEL, LiveServer, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes


def _value(text: str, name: str, **labels: str) -> float | None:
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples.get((name, frozenset(labels.items())))


class _Streams:
    """Long streams held open (one event read) and cancelled through the API at the end, so
    they do not keep the shared tiny model busy after the test."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self.sessions: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.release = asyncio.Event()

    async def _one(self, started: asyncio.Event) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            self.sessions.append(response.headers["x-session-id"])
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 1:  # the first chunk carries the first token: decoding now
                    started.set()
                    await self.release.wait()
                    return

    def start(self, n: int) -> list[asyncio.Event]:
        events = [asyncio.Event() for _ in range(n)]
        self.tasks += [asyncio.create_task(self._one(e)) for e in events]
        return events

    async def open(self, n: int) -> None:
        events = self.start(n)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=60)

    async def close(self) -> None:
        for sid in self.sessions:
            await self.client.post(f"/v1/cancel/{sid}")
        self.release.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_three_decoding_streams_are_running_not_waiting(
    live_server: Callable[..., LiveServer],
) -> None:
    server = live_server(max_num_seqs=32)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        streams = _Streams(client)
        try:
            await streams.open(3)
            text = (await client.get("/metrics")).text
        finally:
            await streams.close()
    assert _value(text, "vlmserve_num_requests_running", model=MODEL) == 3
    assert _value(text, "vlmserve_num_requests_waiting", model=MODEL) == 0
    assert _value(text, "vlmserve_queue_depth", model=MODEL) == 0
    assert _value(text, "vllm:num_requests_running", model_name=MODEL, engine="0") == 3
    assert _value(text, "vllm:num_requests_waiting", model_name=MODEL, engine="0") == 0
    # KV blocks in use: three short streams hold a sliver of the default budget
    assert 0 < _value(text, "vllm:kv_cache_usage_perc", model_name=MODEL, engine="0") < 0.01
    assert _value(text, "vlmserve_kv_cache_usage_ratio", model=MODEL) == _value(
        text, "vllm:kv_cache_usage_perc", model_name=MODEL, engine="0"
    )
    assert _value(text, "vlmserve_kv_cache_bytes", model=MODEL) > 0
    # the streams are counted under their route, not "unmatched"
    assert _value(text, "vlmserve_requests_in_flight", route="/v1/chat/completions") == 3
    assert not _value(text, "vlmserve_requests_in_flight", route="unmatched")


@pytest.fixture
def two_slot_server(tiny_dir: Path) -> Iterator[LiveServer]:
    settings = make_settings(tiny_dir, max_num_seqs=2)
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    with LiveServer(build_app(settings, models=models)) as server:
        yield server
    models.close()


async def test_requests_beyond_the_slots_are_waiting(two_slot_server: LiveServer) -> None:
    server = two_slot_server
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        streams = _Streams(client)
        try:
            await streams.open(2)
            streams.start(1)
            for _ in range(300):  # until the third request reached the engine's queue
                text = (await client.get("/metrics")).text
                if _value(text, "vllm:num_requests_waiting", model_name=MODEL, engine="0") == 1:
                    break
                await asyncio.sleep(0.02)
        finally:
            await streams.close()
    assert _value(text, "vllm:num_requests_waiting", model_name=MODEL, engine="0") == 1
    assert _value(text, "vllm:num_requests_running", model_name=MODEL, engine="0") == 2
    assert 0 < _value(text, "vllm:kv_cache_usage_perc", model_name=MODEL, engine="0") < 0.01


async def test_step_time_by_phase_and_memory_are_exported(
    live_server: Callable[..., LiveServer],
) -> None:
    """Seed 002's engine figures: step time split into vision / prefill / decode, memory
    held by the weights and by the process."""
    server = live_server()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        before = (await client.get("/metrics")).text
        url = data_url(image_bytes(48, 48), "image/png")
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "what is it?"},
                    ],
                }
            ],
        }
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        after = (await client.get("/metrics")).text

    def phase(text: str, name: str) -> float:
        return _value(text, "vlmserve_engine_step_seconds_total", model=MODEL, phase=name) or 0.0

    for name in ("vision", "prefill", "decode"):
        assert phase(after, name) > phase(before, name), name
    weights = _value(after, "vlmserve_model_weights_bytes", model=MODEL)
    assert weights > 1_000_000  # the tiny Qwen2-VL's float32 weights
    assert _value(after, "process_resident_memory_bytes") > weights
    assert _value(after, "vlmserve_device_memory_bytes", model=MODEL) == 0  # CPU
