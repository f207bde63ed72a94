"""Request media made in memory: random-noise PNGs (Pillow) and MP4s (PyAV), as data URLs.

Noise, not gradients: every pixel is independent, so images compress as little as real photos
would and two seeds never collide in a server-side vision cache.
"""

from __future__ import annotations

import io
import random

from PIL import Image

from vlmserve.media.encode import data_url, encode_mp4

__all__ = ["data_url", "noise_image", "noise_mp4", "noise_png", "pixel_png"]


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def pixel_png() -> bytes:
    """The smallest valid image: one red pixel (preflight's vision probe)."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def noise_mp4(frames: int, width: int = 64, height: int = 64, fps: int = 8, seed: int = 0) -> bytes:
    """An MP4 of ``frames`` noise frames: H.264 where PyAV has libx264, else MPEG-4 part 2."""
    frames_ = (noise_image(width, height, seed * 100_003 + i) for i in range(frames))
    return encode_mp4(frames_, width, height, fps)
