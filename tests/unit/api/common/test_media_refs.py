"""Media kept by ``uuid`` (``api/common/media_refs.py``): per key, a lifetime renewed by each
use, a byte budget, and the options it was processed with."""

from __future__ import annotations

import pytest
from PIL import Image

from vlmserve.api.common.media_refs import MediaRefs
from vlmserve.engine.types import ImagePart
from vlmserve.errors import InvalidRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def part(size: int = 10) -> ImagePart:
    return ImagePart(Image.new("RGB", (size, size)))


def test_an_entry_lives_ttl_after_its_last_use() -> None:
    clock = Clock()
    refs = MediaRefs(ttl_seconds=60, max_bytes=10**6, clock=clock)
    kept = part()
    refs.put("key-a", "cat", kept, "o")
    clock.now = 50
    assert refs.get("key-a", "cat", "o", "p") is kept  # renewed: lives until 110
    clock.now = 100
    assert refs.get("key-a", "cat", "o", "p") is kept
    clock.now = 161
    with pytest.raises(InvalidRequest) as caught:
        refs.get("key-a", "cat", "o", "p")
    assert (
        caught.value.code == "media_uuid_unknown" and "send the data again" in caught.value.message
    )


def test_another_key_or_other_options_cannot_use_it() -> None:
    refs = MediaRefs(ttl_seconds=60, max_bytes=10**6)
    refs.put("key-a", "cat", part(), "detail=auto")
    with pytest.raises(InvalidRequest) as other_key:
        refs.get("key-b", "cat", "detail=auto", "p")
    assert other_key.value.code == "media_uuid_unknown"
    with pytest.raises(InvalidRequest) as other_options:
        refs.get("key-a", "cat", "detail=low", "p")
    assert other_options.value.code == "media_uuid_options"


def test_the_byte_budget_drops_the_least_recently_used() -> None:
    refs = MediaRefs(ttl_seconds=60, max_bytes=2 * 10 * 10 * 3)  # two 10x10 RGB images
    for name in ("a", "b"):
        refs.put("k", name, part(), "o")
    refs.get("k", "a", "o", "p")  # b is now the least recently used
    refs.put("k", "c", part(), "o")
    assert refs.get("k", "a", "o", "p") and refs.get("k", "c", "o", "p")
    with pytest.raises(InvalidRequest):
        refs.get("k", "b", "o", "p")
    assert refs.stats()["bytes"] == 600
