"""The vision-tower cache: content-addressed, LRU by bytes, and invisible in the output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.models.vision_cache import VisionCache, content_key
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, SamplingParams, TextPart
from vlmserve.testing.media import gradient_image


def features(kib: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((kib * 256,), fill)  # float32: 1 KiB per 256 values


def test_lru_evicts_the_least_recently_used_entries_by_bytes() -> None:
    cache = VisionCache(max_bytes=3 * 1024)
    cache.put(b"a", features(1))
    cache.put(b"b", features(1))
    assert cache.get(b"a") is not None  # "a" is now the most recent
    cache.put(b"c", features(2))  # 4 KiB > 3 KiB: the least recent ("b") goes
    assert cache.get(b"b") is None
    assert cache.get(b"a") is not None and cache.get(b"c") is not None
    assert cache.stats() == {"hits": 3, "misses": 1, "bytes": 3 * 1024, "entries": 2}


def test_an_entry_larger_than_the_cache_is_not_kept() -> None:
    cache = VisionCache(max_bytes=1024)
    cache.put(b"small", features(1))
    cache.put(b"huge", features(2))
    assert cache.get(b"huge") is None and cache.get(b"small") is not None


def test_content_key_depends_on_pixels_and_grid_only() -> None:
    pixels = torch.rand(16, 1176)
    grid = torch.tensor([[1, 4, 4]])
    same = content_key("image", pixels.clone(), grid.clone())
    assert content_key("image", pixels, grid) == same
    changed = pixels.clone()
    changed[3, 7] += 1e-3
    assert content_key("image", changed, grid) != same
    assert content_key("image", pixels, torch.tensor([[1, 2, 8]])) != same
    assert content_key("video", pixels, grid) != same


def ask(image_seed: int, size: tuple[int, int] = (64, 48)) -> GenerateRequest:
    parts = [ImagePart(gradient_image(*size, seed=image_seed)), TextPart("What is this?")]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return GenerateRequest("vc", [ChatMessage("user", parts)], sampling)


async def tokens(backend: HFChatBackend, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async for chunk in backend.generate(await backend.prepare(req)):
        out += chunk.token_ids
    return out


def backend_with(tiny_dir: Path, cache_bytes: int) -> HFChatBackend:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    backend = HFChatBackend(
        "tiny",
        options,
        max_model_len=4096,
        max_queued=8,
        vision_cache_bytes=cache_bytes,
        processor_cache_bytes=0,
    )
    backend.load()
    return backend


@pytest.fixture(scope="module")
def uncached(tiny_dir: Path) -> Iterator[HFChatBackend]:
    backend = backend_with(tiny_dir, 0)
    yield backend
    backend.close()


async def test_a_repeated_image_is_a_hit_with_identical_output(
    tiny_dir: Path, uncached: HFChatBackend
) -> None:
    backend = backend_with(tiny_dir, 64 * 1024 * 1024)
    try:
        first = await tokens(backend, ask(1))
        assert backend.vision_cache_stats() == {"hits": 0, "misses": 1, "bytes": 2048, "entries": 1}
        second = await tokens(backend, ask(1))
        assert backend.vision_cache_stats()["hits"] == 1
        await tokens(backend, ask(2))
        assert backend.vision_cache_stats()["misses"] == 2
        assert first == second == await tokens(uncached, ask(1))  # same as the vision tower's
    finally:
        backend.close()


async def test_the_backend_cache_evicts_by_bytes(tiny_dir: Path) -> None:
    backend = backend_with(tiny_dir, 3000)  # one 64x48 image's features: 4 tokens x 128 x 4 B
    try:
        await tokens(backend, ask(1))
        await tokens(backend, ask(2))  # evicts image 1
        assert backend.vision_cache_stats()["entries"] == 1
        await tokens(backend, ask(1))
        assert backend.vision_cache_stats() == {"hits": 0, "misses": 3, "bytes": 2048, "entries": 1}
    finally:
        backend.close()


async def test_disabled_cache_counts_misses_and_keeps_nothing(uncached: HFChatBackend) -> None:
    before = uncached.vision_cache_stats()["misses"]
    await tokens(uncached, ask(3))
    await tokens(uncached, ask(3))
    stats = uncached.vision_cache_stats()
    assert stats["misses"] - before == 2
    assert stats["hits"] == stats["bytes"] == stats["entries"] == 0
