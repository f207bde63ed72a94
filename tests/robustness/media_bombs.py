"""Builders of hostile media: small files that declare huge images, lie about frame counts, or
use formats outside the allow-list. Pure bytes, no server."""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from vlmserve.testing.media import image_bytes

__all__ = ["gif_huge", "jpeg_truncated", "pil_bytes", "png_bomb", "png_ztxt_bomb", "video"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid PNG header declaring width x height grey pixels; the data is a few KB of zlib."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compressobj(9)
    idat = rows.compress(b"\x00" * (width + 1) * 64) + rows.flush(zlib.Z_SYNC_FLUSH)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def png_ztxt_bomb(megabytes: int = 64) -> bytes:
    """An 8x8 PNG carrying a zTXt chunk that inflates to ``megabytes`` MB of zeros."""
    png = image_bytes(8, 8)
    text = _chunk(b"zTXt", b"bomb\x00\x00" + zlib.compress(b"\x00" * megabytes * 2**20, 9))
    return png[:33] + text + png[33:]  # after the 8-byte signature and the 25-byte IHDR


def gif_huge(width: int = 65535, height: int = 65535) -> bytes:
    """A GIF whose screen and frame declare 65535 x 65535 pixels, with a one-code image."""
    header = (
        b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00" * 3 + b"\xff" * 3
    )
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return header + frame + b"\x02\x02\x44\x01\x00\x3b"


def jpeg_truncated() -> bytes:
    data = image_bytes(64, 64, fmt="JPEG")
    return data[: len(data) // 2]


def pil_bytes(fmt: str, size: tuple[int, int] = (16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format=fmt)
    return buf.getvalue()


def video(frames: int, width: int, height: int, fmt: str = "mp4", fps: int = 25) -> bytes:
    """``frames`` black frames in MPEG-4 part 2 (fast to encode; the header carries the count)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        planes = np.zeros((height * 3 // 2, width), np.uint8)  # yuv420p: no colour conversion
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()
