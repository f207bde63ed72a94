"""Synthetic media for tests, benchmarks, preflight and the load tester: PNG/JPEG/MP4 in memory."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from vlmserve.media.encode import data_url, encode_mp4

__all__ = ["data_url", "gradient_image", "image_bytes", "mp4_bytes"]


def gradient_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic, non-uniform RGB image (so the vision tower sees real structure)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            x * 255 // max(1, width - 1),
            y * 255 // max(1, height - 1),
            (x + y) * 127 // max(1, width + height - 2),
        ],
        axis=-1,
    )
    noise = rng.integers(0, 32, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def image_bytes(width: int = 64, height: int = 64, fmt: str = "PNG", seed: int = 0) -> bytes:
    buf = io.BytesIO()
    gradient_image(width, height, seed).save(buf, format=fmt)
    return buf.getvalue()


def mp4_bytes(
    frames: int = 8, width: int = 64, height: int = 48, fps: int = 8, seed: int = 0
) -> bytes:
    """An H.264 (or MPEG-4 part 2, where libx264 is missing) MP4 made with PyAV; frame ``i``
    is ``gradient_image(seed=seed * 100_003 + i)``, so clips of different seeds differ."""
    frames_ = (gradient_image(width, height, seed=seed * 100_003 + i) for i in range(frames))
    return encode_mp4(frames_, width, height, fps)
