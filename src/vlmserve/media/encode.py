"""Encoding the other way round: images -> MP4 bytes, bytes -> data: URLs (clients, tests).

No torch; PyAV is imported only when a video is made.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from fractions import Fraction

from PIL import Image

__all__ = ["data_url", "encode_mp4"]


def encode_mp4(frames: Iterable[Image.Image], width: int, height: int, fps: int = 8) -> bytes:
    """An MP4 of the given frames: H.264 where PyAV has libx264, else MPEG-4 part 2."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for i, image in enumerate(frames):
            frame = av.VideoFrame.from_image(image)
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
