"""decode_image / load_image: formats, pixel limits before decoding, RGB conversion."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from vlmserve.errors import MediaError, PayloadTooLarge
from vlmserve.media import MediaPolicy, decode_image, load_image

POLICY = MediaPolicy()


def encode(img: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def png_with_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` but carries only a few bytes of data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    crc = struct.pack(">I", zlib.crc32(chunk))
    idat = zlib.compress(b"\x00" * 64)
    idat_chunk = b"IDAT" + idat
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + crc
        + struct.pack(">I", len(idat))
        + idat_chunk
        + struct.pack(">I", zlib.crc32(idat_chunk))
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_allowed_formats_decode_to_rgb(fmt: str) -> None:
    img = decode_image(encode(Image.new("RGB", (40, 30), (200, 40, 40)), fmt), POLICY)
    assert (img.mode, img.size) == ("RGB", (40, 30))
    red, green, _ = img.getpixel((20, 15))
    assert red > 150 and green < 90


@pytest.mark.parametrize("size", [(1, 1), (1, 300), (300, 1)])
def test_tiny_and_thin_images_are_valid(size: tuple[int, int]) -> None:
    assert decode_image(encode(Image.new("L", size, 7)), POLICY).size == size


def test_transparency_is_composited_onto_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    img = decode_image(encode(rgba), POLICY)
    assert img.getpixel((1, 1)) == (255, 255, 255)
    assert img.getpixel((0, 0)) == (255, 0, 0)
    assert decode_image(encode(Image.new("LA", (2, 2), (0, 0))), POLICY).getpixel((0, 0)) == (
        255,
        255,
        255,
    )


def test_palette_with_transparent_index_is_composited_onto_white() -> None:
    pal = Image.new("P", (3, 3), 1)
    pal.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    pal.putpixel((0, 0), 0)
    img = decode_image(encode(pal, transparency=0), POLICY)
    assert img.getpixel((0, 0)) == (255, 255, 255)
    assert img.getpixel((2, 2)) == (10, 200, 10)


def test_sixteen_bit_greyscale_is_scaled_not_clipped() -> None:
    arr = np.array([[0, 32768, 65535]], dtype=np.uint16)
    img = decode_image(encode(Image.fromarray(arr)), POLICY)
    assert [img.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_cmyk_jpeg_becomes_rgb() -> None:
    img = decode_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"), POLICY)
    assert img.mode == "RGB"


def test_animated_gif_gives_the_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 0, 255)]]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    red, _, blue = decode_image(data, POLICY).getpixel((4, 4))
    assert red > 200 and blue < 50


def test_exif_orientation_is_applied() -> None:
    img = Image.new("RGB", (40, 20), (0, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    decoded = decode_image(encode(img, "JPEG", exif=exif.tobytes()), POLICY)
    assert decoded.size == (20, 40)


def test_format_outside_the_policy_names_format_and_setting() -> None:
    with pytest.raises(
        MediaError, match=r"TIFF is not accepted.*PNG, JPEG.*VLMSERVE_MEDIA_IMAGE_FORMATS"
    ):
        decode_image(encode(Image.new("RGB", (4, 4)), "TIFF"), POLICY)
    jpeg = encode(Image.new("RGB", (4, 4)), "JPEG")
    with pytest.raises(MediaError, match="JPEG is not accepted; send one of PNG"):
        decode_image(jpeg, MediaPolicy(image_formats=("PNG",)))


def test_pixel_limit_is_checked_with_size_in_the_message() -> None:
    with pytest.raises(PayloadTooLarge) as info:
        decode_image(encode(Image.new("RGB", (100, 60))), MediaPolicy(max_image_pixels=5000))
    assert info.value.message.startswith(
        "image is 100x60 pixels; the limit is 5000 pixels (VLMSERVE_MAX_IMAGE_PIXELS)"
    )
    assert decode_image(encode(Image.new("RGB", (100, 50))), MediaPolicy(max_image_pixels=5000))


@pytest.mark.parametrize(("width", "height"), [(12000, 9000), (5000, 4000), (30000, 30000)])
def test_huge_header_is_refused_before_decoding(width: int, height: int) -> None:
    # The data behind the header is a few bytes: decoding would fail as truncated, so a
    # PayloadTooLarge proves the header check came first (whichever guard fired).
    with pytest.raises(PayloadTooLarge, match="VLMSERVE_MAX_IMAGE_PIXELS"):
        decode_image(png_with_header(width, height), POLICY)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"definitely not an image", "not a recognised image"),
        (b"%PDF-1.7\n...", "PDF is not accepted"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG is not accepted"),
        (encode(Image.new("RGB", (64, 64), (1, 2, 3)))[:60], "truncated or corrupt"),
        (encode(Image.new("RGB", (64, 64)), "JPEG")[:200], "truncated or corrupt"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "truncated or corrupt"),
    ],
)
def test_bad_data_is_a_media_error_with_a_clean_message(data: bytes, match: str) -> None:
    with pytest.raises(MediaError, match=match) as info:
        decode_image(data, POLICY)
    message = info.value.message
    assert "Traceback" not in message and " at 0x" not in message and "/" not in message


async def test_load_image_from_a_data_url() -> None:
    png = encode(Image.new("RGB", (5, 6), (0, 255, 0)))
    img = await load_image("data:image/png;base64," + base64.b64encode(png).decode(), POLICY)
    assert (img.size, img.getpixel((0, 0))) == ((5, 6), (0, 255, 0))


async def test_load_image_over_http_through_the_guard() -> None:
    png = encode(Image.new("RGB", (3, 3), (9, 9, 9)))
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, content=png, headers={"Content-Type": "image/png"})

    async def resolver(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        img = await load_image(
            "https://media.example.test/a.png", POLICY, client=client, resolver=resolver
        )
    assert img.size == (3, 3) and seen == ["93.184.216.34"]
