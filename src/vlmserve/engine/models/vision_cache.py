"""Vision-tower outputs kept by content hash in a ``ByteLRU`` (bounded in bytes).

A chat that sends the same image again (every turn of a conversation about one picture, a
batch of questions about one document) skips the vision tower: its merged patch features
are looked up by a hash of the exact preprocessed pixels and grid.
"""

from __future__ import annotations

import torch
from blake3 import blake3

from vlmserve.engine.byte_lru import ByteLRU

__all__ = ["VisionCache", "content_key"]


def content_key(kind: str, pixels: torch.Tensor, grid_thw: torch.Tensor) -> bytes:
    """A 128-bit hash of one image's (or video's) preprocessed patches and its grid (BLAKE3:
    a video's patches are tens of MB, hashed at several GB/s without the GIL)."""
    digest = blake3(kind.encode())
    digest.update(str(tuple(int(n) for n in grid_thw.reshape(-1))).encode())
    digest.update(str(pixels.dtype).encode())
    raw = pixels.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    digest.update(memoryview(raw))
    return digest.digest(16)


def _tensor_bytes(features: torch.Tensor) -> int:
    return features.numel() * features.element_size()


class VisionCache(ByteLRU[bytes, torch.Tensor]):
    """Thread-unsafe by design: only the engine thread touches it (``stats`` reads ints)."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, _tensor_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0
