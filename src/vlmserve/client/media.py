"""Request media made in memory: random-noise PNGs (Pillow) and MP4s (PyAV), as data URLs.

Noise, not gradients: every pixel is independent, so images compress as little as real photos
would and two seeds never collide in a server-side vision cache.
"""

from __future__ import annotations

import base64
import io
import random
from fractions import Fraction

from PIL import Image

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
    import av  # imported here: only video payloads pay for it

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for i in range(frames):
            frame = av.VideoFrame.from_image(noise_image(width, height, seed * 100_003 + i))
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
