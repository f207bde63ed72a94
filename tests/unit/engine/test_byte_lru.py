"""The byte-bounded LRU behind the vision-feature and image-processor caches, and the queue
places shared by the in-process chat backend and the engine process's client."""

from __future__ import annotations

import pytest

from vlmserve.engine.admission import QueuePlaces
from vlmserve.engine.byte_lru import ByteLRU
from vlmserve.errors import Overloaded


def test_values_are_evicted_least_recently_used_first_by_their_bytes() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10, len)
    cache.put("a", b"aaaa")
    cache.put("b", b"bbbb")
    assert cache.get("a") == b"aaaa"  # now the most recent
    cache.put("c", b"cccc")  # 12 bytes: "b" goes
    assert cache.get("b") is None and cache.get("c") == b"cccc"
    assert cache.stats() == {"hits": 2, "misses": 1, "bytes": 8, "entries": 2}
    cache.put("big", b"x" * 11)  # over the bound alone: not kept, nothing evicted
    cache.put("a", b"other")  # held already: kept as it was
    assert cache.get("a") == b"aaaa" and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_queue_places_are_held_until_released_once() -> None:
    places = QueuePlaces("m")
    first = places.admit(waiting=0, limit=2)
    second = places.admit(waiting=0, limit=2)
    with pytest.raises(Overloaded, match=r"^2 requests are already waiting for 'm' "):
        places.admit(waiting=0, limit=2)
    first()
    first()  # idempotent
    assert places.reserved == 1
    with pytest.raises(Overloaded):
        places.admit(waiting=1, limit=2)
    second()
    places.admit(waiting=100, limit=None)  # no limit
    places.refuse_if_full(1, 2)
    with pytest.raises(Overloaded):
        places.refuse_if_full(2, 2)
