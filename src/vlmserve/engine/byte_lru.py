"""``ByteLRU``: values by key, bounded by the bytes they hold, least recently used evicted
first. The vision-feature cache and the image-processor cache are both one.

Not thread-safe: a cache touched from several threads holds its own lock around the calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["ByteLRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """At most ``max_bytes`` of values (each ``size(value)`` bytes); ``hits`` and ``misses``
    count the lookups."""

    def __init__(self, max_bytes: int, size: Callable[[V], int]):
        self.max_bytes = max_bytes
        self._size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None (a miss)."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` (unless it alone is over the bound, or ``key`` is held), evicting
        the least recently used values until the rest fit."""
        size = self._size(value)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= self._size(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bytes": self.bytes,
            "entries": len(self._entries),
        }
