"""read_source for data: URLs, raw base64 and local paths (http(s) is in test_media_fetch_http)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from vlmserve.errors import MediaBlocked, MediaError, PayloadTooLarge
from vlmserve.media import MediaPolicy, read_source
from vlmserve.media import fetch as fetch_module

PAYLOAD = bytes(range(256)) * 3  # every byte value, so urlsafe and standard alphabets differ
JPEG_START = b"\xff\xd8\xff\xe0" + b"\x00" * 60
POLICY = MediaPolicy()


async def read(source: str, policy: MediaPolicy = POLICY, kind: str = "image") -> bytes:
    return await read_source(source, policy, kind=kind)  # type: ignore[arg-type]


async def test_data_url_with_base64() -> None:
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    assert await read(url) == PAYLOAD


async def test_data_url_is_case_insensitive_and_ignores_whitespace_and_params() -> None:
    text = base64.encodebytes(PAYLOAD).decode()  # MIME line breaks every 76 characters
    url = f"DATA:Video/MP4;name=clip.mp4;BASE64,{text}"
    assert await read(url, kind="video") == PAYLOAD


async def test_percent_encoded_data_url() -> None:
    assert await read("data:image/png,%89PNG%0D%0A") == b"\x89PNG\r\n"


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("data:video/mp4;base64,AAAA", "image"),
        ("data:image/png;base64,AAAA", "video"),
        ("data:text/plain;base64,AAAA", "image"),
        ("data:;base64,AAAA", "image"),
        ("data:application/octet-stream;base64,AAAA", "video"),
    ],
)
async def test_data_url_media_type_must_fit_the_kind(url: str, kind: str) -> None:
    with pytest.raises(MediaError, match="media type"):
        await read(url, kind=kind)


async def test_data_url_without_comma() -> None:
    with pytest.raises(MediaError, match="','"):
        await read("data:image/png;base64")


@pytest.mark.parametrize(
    "text",
    [
        base64.b64encode(PAYLOAD).decode(),
        base64.urlsafe_b64encode(PAYLOAD).decode(),
        base64.b64encode(PAYLOAD).decode().rstrip("="),
        base64.urlsafe_b64encode(PAYLOAD[:-1]).decode().rstrip("="),
        base64.encodebytes(PAYLOAD).decode(),
        "  \n" + base64.b64encode(PAYLOAD).decode() + "\r\n",
    ],
)
async def test_raw_base64_variants(text: str) -> None:
    assert (await read(text)).rstrip(b"\xff") == PAYLOAD.rstrip(b"\xff")


async def test_base64_jpeg_starting_with_slash_is_not_taken_for_a_path() -> None:
    text = base64.b64encode(JPEG_START).decode()
    assert text.startswith("/9j/")
    assert await read(text) == JPEG_START


@pytest.mark.parametrize("text", ["!!!!", "abcde", "QQ==QQ==", "ab=cd", "ünïcode", "===="])
async def test_bad_base64_is_a_media_error(text: str) -> None:
    with pytest.raises(MediaError):
        await read(text)


async def test_oversized_base64_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_decode(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decoded an oversized payload")

    monkeypatch.setattr(fetch_module.base64, "b64decode", must_not_decode)
    policy = MediaPolicy(max_bytes=100)
    text = base64.b64encode(b"x" * 200).decode()
    with pytest.raises(PayloadTooLarge, match=r"limit is 100 bytes.*VLMSERVE_MAX_MEDIA_BYTES"):
        await read(text, policy)
    with pytest.raises(PayloadTooLarge):
        await read("data:image/png;base64," + text, policy)
    with pytest.raises(PayloadTooLarge):
        await read("A" * 10_000_000, policy)


async def test_base64_size_limit_is_exact() -> None:
    policy = MediaPolicy(max_bytes=100)
    assert len(await read(base64.b64encode(b"x" * 100).decode(), policy)) == 100
    with pytest.raises(PayloadTooLarge):
        await read(base64.b64encode(b"x" * 101).decode(), policy)


async def test_oversized_percent_encoded_data_url() -> None:
    with pytest.raises(PayloadTooLarge):
        await read("data:image/png," + "a" * 101, MediaPolicy(max_bytes=100))


@pytest.mark.parametrize("source", ["", "   ", "data:image/png;base64,", "data:image/png,"])
async def test_empty_sources(source: str) -> None:
    with pytest.raises(MediaError):
        await read(source)


@pytest.mark.parametrize(
    "source", ["gopher://x/", "ftp://x/a.png", "C:\\images\\a.png", "javascript:alert(1)"]
)
async def test_other_schemes_are_blocked(source: str) -> None:
    with pytest.raises(MediaBlocked, match="scheme"):
        await read(source)


# -- local paths ------------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(PAYLOAD)
    (root / "sub").mkdir()
    (root / "sub" / "dog file.png").write_bytes(b"dog")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    return root


def allow(root: Path, **kw: object) -> MediaPolicy:
    return MediaPolicy(allowed_local_roots=(str(root),), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("source", ["/etc/passwd", "file:///etc/passwd", "/nonexistent.png"])
async def test_local_paths_refused_by_default_naming_the_setting(source: str) -> None:
    with pytest.raises(MediaBlocked, match="VLMSERVE_ALLOWED_LOCAL_MEDIA_PATH"):
        await read(source)


async def test_local_path_inside_a_root(media_root: Path) -> None:
    policy = allow(media_root)
    assert await read(str(media_root / "cat.png"), policy) == PAYLOAD
    assert await read(f"file://{media_root}/cat.png", policy) == PAYLOAD
    assert await read(f"file://localhost{media_root}/sub/dog%20file.png", policy) == b"dog"


@pytest.mark.parametrize(
    "relative", ["../secret.txt", "sub/../../secret.txt", "../media-evil/x.png"]
)
async def test_traversal_out_of_the_root_is_blocked(media_root: Path, relative: str) -> None:
    source = f"{media_root}/{relative}"
    with pytest.raises(MediaBlocked, match="outside") as info:
        await read(source, allow(media_root))
    assert str(media_root.parent) not in info.value.message.replace(source, "")


async def test_symlink_leading_out_of_the_root_is_blocked(media_root: Path) -> None:
    os.symlink(media_root.parent / "secret.txt", media_root / "link.png")
    with pytest.raises(MediaBlocked, match="outside"):
        await read(str(media_root / "link.png"), allow(media_root))


async def test_symlink_inside_the_root_is_followed(media_root: Path) -> None:
    os.symlink(media_root / "cat.png", media_root / "sub" / "alias.png")
    assert await read(str(media_root / "sub" / "alias.png"), allow(media_root)) == PAYLOAD


async def test_root_given_through_a_symlink_still_matches(media_root: Path) -> None:
    link = media_root.parent / "media-link"
    os.symlink(media_root, link)
    assert await read(str(media_root / "cat.png"), allow(link)) == PAYLOAD


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("missing.png", MediaError, "does not exist"),
        ("sub", MediaError, "not a regular file"),
    ],
)
async def test_unreadable_local_files(
    media_root: Path, name: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        await read(str(media_root / name), allow(media_root))


async def test_local_file_over_the_byte_limit(media_root: Path) -> None:
    with pytest.raises(PayloadTooLarge, match="VLMSERVE_MAX_MEDIA_BYTES"):
        await read(str(media_root / "cat.png"), allow(media_root, max_bytes=100))


async def test_file_url_with_a_remote_host_is_blocked(media_root: Path) -> None:
    with pytest.raises(MediaBlocked):
        await read(f"file://fileserver{media_root}/cat.png", allow(media_root))


async def test_fifo_under_a_root_is_refused_without_hanging(media_root: Path) -> None:
    os.mkfifo(media_root / "pipe.png")
    with pytest.raises(MediaError, match="not a regular file"):
        await read(str(media_root / "pipe.png"), allow(media_root))
