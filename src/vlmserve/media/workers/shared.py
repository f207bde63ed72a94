"""Decoded pixels handed from a media worker to the API process through shared memory.

A worker's result is walked once: every PIL image in it (alone, in a list or tuple, or in a
dataclass such as ``VideoFrames``) is written into its own ``multiprocessing.shared_memory``
block and replaced by a ``SharedImage`` naming it. Only those small descriptors cross the
pipe; the API process maps each block, copies the pixels into an image and unlinks it. A
1280x960 photo is 3.7 MB of pixels: pickled through the pipe it would be copied four times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

from PIL import Image

__all__ = ["SharedImage", "from_shared", "to_shared"]


@dataclass(slots=True, frozen=True)
class SharedImage:
    name: str  # the shared memory block
    mode: str
    size: tuple[int, int]
    nbytes: int

    @classmethod
    def put(cls, image: Image.Image) -> SharedImage:
        data = image.tobytes()
        block = shared_memory.SharedMemory(create=True, size=max(1, len(data)))
        try:
            _view(block)[: len(data)] = data
        finally:
            block.close()
        return cls(block.name, image.mode, image.size, len(data))

    def take(self) -> Image.Image:
        """The image, copied out of its block; the block is gone afterwards."""
        block = shared_memory.SharedMemory(name=self.name)
        try:
            return Image.frombytes(self.mode, self.size, bytes(_view(block)[: self.nbytes]))
        finally:
            block.close()
            block.unlink()


def _view(block: shared_memory.SharedMemory) -> memoryview:
    view = block.buf
    if view is None:  # only after close()
        raise RuntimeError(f"shared memory block {block.name} is closed")
    return view


def to_shared(value: Any) -> Any:
    """``value`` with each PIL image replaced by a ``SharedImage`` (runs in the worker)."""
    return _walk(value, lambda image: SharedImage.put(image), Image.Image)


def from_shared(value: Any) -> Any:
    """``to_shared`` undone (runs in the API process)."""
    return _walk(value, lambda shared: shared.take(), SharedImage)


def _walk(value: Any, convert: Any, kind: type) -> Any:
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, list):
        return [_walk(v, convert, kind) for v in value]
    if isinstance(value, tuple):
        return tuple(_walk(v, convert, kind) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, convert, kind) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _walk(getattr(value, f.name), convert, kind) for f in _fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def _fields(value: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(value) if f.init]
