"""Image-processor outputs kept by image content (vLLM's multimodal processor cache).

A repeated image (every turn of a chat about one picture, many questions about one document)
skips resizing, normalising and patchifying, and — because its entry also carries the key the
vision cache files its features under — hashing its pixel patches again.

Only for processors whose output is per-image patch rows plus a grid (Qwen2-VL's family):
there each image is preprocessed on its own and the outputs are concatenated, so processing
images one by one, some from the cache, gives exactly what one call over all of them gives.
Any other output shape is passed through uncached.

An image is keyed by a hash of its pixels (``pixel_digest``): a ``LentImage`` (the engine
process's view of a shared block) brings the one its writer made, so the engine process
never reads it to key it; and with ``remote`` (``preprocess.py``: worker processes) a miss
on such an image is preprocessed there from the block, so its pixels never enter this
process at all. That keeps the image work from holding this process's GIL, which the
request path shares (a thread's lower OS priority does not carry over to the GIL).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Protocol

import torch
from PIL import Image

from vlmserve.engine.byte_lru import ByteLRU
from vlmserve.media.workers.shared import (
    LentImage,
    SharedImage,
    map_rgb,
    pixel_digest,
    read_block,
)

__all__ = ["CachedImageProcessor", "Remote", "block_call", "image_key", "install"]

_KEYS = ("pixel_values", "image_grid_thw")


class _Entry:
    __slots__ = ("grid", "key", "pixels")

    def __init__(self, pixels: torch.Tensor, grid: torch.Tensor, key: bytes):
        self.pixels, self.grid, self.key = pixels, grid, key

    def size(self) -> int:
        return self.pixels.numel() * self.pixels.element_size()


def image_key(image: Any, options: str) -> bytes | None:
    """A 128-bit hash of a decoded image's pixels, size and mode plus the call's options."""
    if isinstance(image, LentImage) and image.pixel_digest:
        pixels = image.pixel_digest
    elif isinstance(image, Image.Image):
        pixels = pixel_digest(image.tobytes())
    else:  # arrays or tensors: not cached
        return None
    digest = hashlib.blake2b(b"image", digest_size=16)
    digest.update(f"{image.mode}|{image.size}|{options}".encode())
    digest.update(pixels)
    return digest.digest()


def block_call(image: Any, inner: Any, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments of ``inner`` (an image processor) for one image, which may be in a
    shared block (a ``LentImage``, or a worker's ``SharedImage``).

    An RGB block goes to a processor of transformers' torchvision backend as an
    [height, width, 3] uint8 view of the block (``map_rgb``): ``process_image`` makes exactly
    that array of a PIL image (``np.array`` of its RGB conversion) before anything else, so
    the output is the same bytes, without reading the block into a PIL image, converting it
    to RGB and packing it back into an array (four copies of a photo's pixels). Other
    processors get a PIL image."""
    shared = image.shared if isinstance(image, LentImage) else image
    if (
        isinstance(shared, SharedImage)
        and shared.mode == "RGB"
        and "input_data_format" not in kwargs
        and _takes_arrays(inner)
    ):
        pixels = image.rgb() if isinstance(image, LentImage) else map_rgb(shared)
        return [pixels], {**kwargs, "input_data_format": "channels_last"}
    if isinstance(image, SharedImage):
        image = Image.frombytes(image.mode, image.size, read_block(image))
    return [image], kwargs


def _takes_arrays(inner: Any) -> bool:
    from transformers.image_processing_backends import TorchvisionBackend

    return isinstance(inner, TorchvisionBackend)


class Remote(Protocol):
    """Preprocesses one image from its shared block elsewhere (``preprocess.py``)."""

    def __call__(
        self, shared: SharedImage, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    @property
    def ready(self) -> bool:
        """Takes images now (until then, and after a failure, they are processed here)."""
        ...


class CachedImageProcessor:
    """Wraps a processor's ``image_processor``; everything but ``__call__`` is delegated."""

    def __init__(self, inner: Any, max_bytes: int):
        self.inner = inner
        self.max_bytes = max_bytes
        self.remote: Remote | None = None  # a ``preprocess.PreprocessPool`` in an engine process
        self._entries: ByteLRU[bytes, _Entry] = ByteLRU(max_bytes, _Entry.size)
        self._lock = threading.Lock()  # request threads share the entries
        self._local = threading.local()  # keys of this thread's last call (see ``take_keys``)
        self._bypass = False  # set when the output layout turns out not to be per-image rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, images: Any, **kwargs: Any) -> Any:
        from transformers.image_utils import make_flat_list_of_images

        self._local.keys = None
        flat = make_flat_list_of_images(images)
        options = repr(sorted(kwargs.items()))
        keys = [image_key(image, options) for image in flat]
        if self._bypass or kwargs.get("return_tensors") != "pt" or None in keys:
            return self.inner(images, **kwargs)
        entries: list[_Entry] = []
        for image, key in zip(flat, keys, strict=True):
            entry = self._get(key) or self._process(image, key, kwargs)  # type: ignore[arg-type]
            if entry is None:  # not the patch-rows-plus-grid layout: never cache this processor
                self._bypass = True
                return self.inner(images, **kwargs)
            entries.append(entry)
        from transformers.image_processing_base import BatchFeature

        self._local.keys = [b"p" + e.key for e in entries]
        return BatchFeature(
            {
                "pixel_values": _joined([e.pixels for e in entries]),
                "image_grid_thw": _joined([e.grid for e in entries]),
            }
        )

    def preprocessed_elsewhere(self) -> bool:
        """Images shared by block are preprocessed by ``remote`` now: it is up, and this
        processor's output has the layout it returns (no bypass)."""
        return self.remote is not None and self.remote.ready and not self._bypass

    def take_keys(self) -> list[bytes] | None:
        """Vision-cache keys of the images of this thread's last call, in order (once)."""
        keys, self._local.keys = getattr(self._local, "keys", None), None
        return keys

    def _process(self, image: Any, key: bytes, kwargs: dict[str, Any]) -> _Entry | None:
        done = None
        if self.remote is not None and isinstance(image, LentImage):
            done = self.remote(image.shared, kwargs)  # None: do it here after all
        if done is None:
            images, call = block_call(image, self.inner, kwargs)
            out = self.inner(images, **call)
            if set(out.keys()) != set(_KEYS):
                return None
            done = out["pixel_values"], out["image_grid_thw"]
        entry = _Entry(done[0], done[1], key)
        self._put(key, entry)
        return entry

    def _get(self, key: bytes) -> _Entry | None:
        with self._lock:
            return self._entries.get(key)

    def _put(self, key: bytes, entry: _Entry) -> None:
        with self._lock:
            self._entries.put(key, entry)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._entries.stats()


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """One image's tensors are returned as they are (read-only downstream): no 5 MB copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def install(processor: Any, max_bytes: int) -> CachedImageProcessor | None:
    """Wrap ``processor.image_processor`` in a cache of ``max_bytes`` (None: off or absent)."""
    inner = getattr(processor, "image_processor", None)
    if max_bytes <= 0 or inner is None:
        return None
    if isinstance(inner, CachedImageProcessor):
        return inner
    cached = CachedImageProcessor(inner, max_bytes)
    processor.image_processor = cached
    return cached
