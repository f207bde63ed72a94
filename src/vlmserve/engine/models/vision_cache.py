"""Vision-tower outputs kept by content hash, least recently used evicted first, bounded in bytes.

A chat that sends the same image again (every turn of a conversation about one picture, a
batch of questions about one document) skips the vision tower: its merged patch features
are looked up by a hash of the exact preprocessed pixels and grid.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

__all__ = ["VisionCache", "content_key"]


def content_key(kind: str, pixels: torch.Tensor, grid_thw: torch.Tensor) -> bytes:
    """A 128-bit hash of one image's (or video's) preprocessed patches and its grid."""
    digest = hashlib.blake2b(kind.encode(), digest_size=16)
    digest.update(str(tuple(int(n) for n in grid_thw.reshape(-1))).encode())
    digest.update(str(pixels.dtype).encode())
    raw = pixels.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    digest.update(memoryview(raw))
    return digest.digest()


class VisionCache:
    """Thread-unsafe by design: only the engine thread touches it (``stats`` reads ints)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found

    def put(self, key: bytes, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = features
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()

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
