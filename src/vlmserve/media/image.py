"""Decode one image under the policy: allowed formats, pixel limit from the header, RGB out.

Pillow is opened with only the allowed format plugins, so hostile bytes never reach the parsers
of formats the server does not serve. Pillow's own decompression-bomb guard (a process-wide
setting) is left alone; when it fires it becomes PayloadTooLarge like our own header check.
"""

from __future__ import annotations

import asyncio
import contextlib
import io

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from vlmserve.errors import MediaError, PayloadTooLarge, VlmserveError
from vlmserve.media.fetch import read_source
from vlmserve.media.netguard import Resolver
from vlmserve.media.policy import SETTING, MediaPolicy

__all__ = ["decode_image", "load_image"]

_ALIASES = {"MPO": "JPEG"}  # multi-picture JPEGs from phone cameras open as MPO
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_HIGH_DEPTH_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
# Leading bytes of formats people send that are not (or not yet) allowed, for a useful message.
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG", "PNG"),
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"GIF8", "GIF"),
    (0, b"BM", "BMP"),
    (8, b"WEBP", "WEBP"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"%PDF", "PDF"),
    (0, b"8BPS", "PSD"),
    (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"<svg", "SVG"),
    (0, b"<?xml", "SVG"),
    (4, b"ftypheic", "HEIC"),
    (4, b"ftypheix", "HEIC"),
    (4, b"ftypmif1", "HEIF"),
    (4, b"ftypavif", "AVIF"),
    (0, b"\x00\x00\x00\x0cjP  ", "JPEG2000"),
    (0, b"qoif", "QOI"),
)


def _allowed(policy: MediaPolicy) -> list[str]:
    return [f.upper() for f in policy.image_formats]


def _sniff(data: bytes) -> str | None:
    for offset, magic, name in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return name
    return None


def _unidentified(data: bytes, policy: MediaPolicy) -> MediaError:
    allowed = ", ".join(_allowed(policy))
    name = _sniff(data)
    if name is not None and name not in _allowed(policy):
        return MediaError(
            f"image format {name} is not accepted; send one of {allowed} "
            f"({SETTING['image_formats']})"
        )
    if name is not None:
        return MediaError(f"the {name} image could not be decoded: it is truncated or corrupt")
    return MediaError(f"the data is not a recognised image; send one of {allowed}")


def _check_header(img: Image.Image, policy: MediaPolicy) -> None:
    fmt = _ALIASES.get(img.format or "", img.format or "?")
    if fmt not in _allowed(policy):
        raise MediaError(
            f"image format {fmt} is not accepted; send one of {', '.join(_allowed(policy))} "
            f"({SETTING['image_formats']})"
        )
    width, height = img.size
    if width * height > policy.max_image_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} pixels; the limit is {policy.max_image_pixels} pixels "
            f"({SETTING['max_image_pixels']}); downscale it before sending"
        )


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and float greyscale scaled to 8 bits instead of clipped."""
    if img.mode == "F":
        return img.convert("L")
    return img.convert("I").point(lambda v: v / 256).convert("L")


def _upright(img: Image.Image) -> Image.Image:
    """The decoded image with its EXIF orientation applied, as an image of its own that
    outlives closing the file's (closing frees the file's pixels). An upright image is
    not copied: the new image shares the decoded pixels (a 1280x960 photo's copy cost 3-6
    ms); a rotated one is transposed once."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, SyntaxError):
        ImageOps.exif_transpose(img, in_place=True)  # unreadable EXIF: the pixels as stored
    return img._new(img.im)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (``img`` itself when it is RGB already)."""
    out = img
    if out.mode in _HIGH_DEPTH_MODES:
        out = _to_8bit(out)
    if out.mode in _ALPHA_MODES or "transparency" in out.info:
        rgba = out.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return out if out.mode == "RGB" else out.convert("RGB")


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Bytes -> RGB image (first frame of animations); MediaError or PayloadTooLarge otherwise."""
    if not data:
        raise MediaError("the image is empty")
    try:
        with Image.open(io.BytesIO(data), formats=_allowed(policy)) as img:
            _check_header(img, policy)  # before load(): the header alone decides
            img.load()
            upright = _upright(img)
        return _to_rgb(upright)
    except (VlmserveError, MemoryError):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PayloadTooLarge(
            f"image has too many pixels to decode safely; the limit is {policy.max_image_pixels} "
            f"pixels ({SETTING['max_image_pixels']})"
        ) from None
    except UnidentifiedImageError:
        raise _unidentified(data, policy) from None
    except Exception:  # hostile input: any decoder failure is a fault in the client's data
        raise MediaError("the image could not be decoded: it is truncated or corrupt") from None


async def load_image(
    source: str,
    policy: MediaPolicy,
    *,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver | None = None,
) -> Image.Image:
    """Read ``source`` (URL, data: URL, base64 or allowed path) and decode it off the loop."""
    data = await read_source(source, policy, kind="image", client=client, resolver=resolver)
    return await asyncio.to_thread(decode_image, data, policy)
