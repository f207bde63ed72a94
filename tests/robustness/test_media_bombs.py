"""Media bombs through the real chat API: each is refused with a 4xx in under 1 s (the legal
1x1 / 1xN images get 200), frames kept never exceed VLMSERVE_MAX_VIDEO_FRAMES, decoding work
never exceeds VLMSERVE_MAX_VIDEO_DECODE_FRAMES, and the peak RSS of the process stays bounded.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import pytest
from media_bombs import gif_huge, jpeg_truncated, pil_bytes, png_bomb, png_ztxt_bomb, video

from conftest import leaks, metric, rss_bytes
from support import MODEL
from vlmserve.testing.media import data_url, image_bytes

pytestmark = pytest.mark.robustness

MiB = 2**20
IMAGE_CASES: list[tuple[str, Callable[[], str], int]] = [
    ("png_20000x20000", lambda: data_url(png_bomb(), "image/png"), 413),
    ("gif_65535x65535", lambda: data_url(gif_huge(), "image/gif"), 413),
    ("png_ztxt_64MiB", lambda: data_url(png_ztxt_bomb(), "image/png"), 400),
    ("jpeg_truncated", lambda: data_url(jpeg_truncated(), "image/jpeg"), 400),
    ("tiff_not_allowed", lambda: data_url(pil_bytes("TIFF"), "image/tiff"), 400),
    ("ico_not_allowed", lambda: data_url(pil_bytes("ICO"), "image/x-icon"), 400),
    ("png_1x1", lambda: data_url(image_bytes(1, 1), "image/png"), 200),
    ("png_1x100", lambda: data_url(image_bytes(1, 100), "image/png"), 200),
    ("png_100x1", lambda: data_url(image_bytes(100, 1), "image/png"), 200),
    ("png_1x300_aspect", lambda: data_url(image_bytes(1, 300), "image/png"), 400),  # > 150:1
]


def _chat(part: dict[str, Any]) -> dict[str, Any]:
    content = [part, {"type": "text", "text": "describe"}]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
    }


def _vm_hwm_reset() -> bool:
    """Reset the peak-RSS counter (VmHWM) of this process; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def _post(client: Any, part: dict[str, Any]) -> tuple[int, float, str]:
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=_chat(part))
    return response.status_code, time.perf_counter() - started, response.text


async def test_image_bombs_are_refused_fast_with_bounded_memory(make_client: Any) -> None:
    client = await make_client(max_tokens=2)
    await _post(
        client, {"type": "image_url", "image_url": {"url": data_url(image_bytes(), "image/png")}}
    )
    sources = {name: build() for name, build, _ in IMAGE_CASES}
    rss0, reset = rss_bytes(), _vm_hwm_reset()
    hwm0 = _vm_hwm()
    report = []
    for name, _, expected in IMAGE_CASES:
        status, seconds, text = await _post(
            client, {"type": "image_url", "image_url": sources[name]}
        )
        report.append(f"{name}: {status} in {seconds * 1000:.0f} ms")
        assert status == expected, (name, status, text[:300])
        assert seconds < (1.0 if status >= 400 else 5.0), (name, seconds)
        assert not leaks(text), text
    growth, peak = rss_bytes() - rss0, _vm_hwm() - hwm0
    print(
        "\n" + "\n".join(report) + f"\nRSS growth {growth / MiB:.1f} MiB, "
        f"peak +{peak / MiB:.1f} MiB (VmHWM reset: {reset})"
    )
    assert growth < 100 * MiB
    if reset:
        assert peak < 200 * MiB


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    return {
        "mp4_10000_frames": video(10000, 16, 16, fps=1000),
        "mp4_8k_header": video(1, 7680, 4320, fps=1),
        "mkv_3000_frames": video(3000, 16, 16, fmt="matroska"),
        "mjpeg_3000_frames": pil_bytes("JPEG", (16, 16)) * 3000,
    }


async def _frames_kept(client: Any) -> float:
    return metric((await client.get("/metrics")).text, "vlmserve_media_frames_total")


@pytest.mark.parametrize(
    ("name", "mime", "settings", "expected"),
    [
        ("mp4_10000_frames", "video/mp4", {"max_video_decode_frames": 1000}, 413),
        ("mp4_10000_frames", "video/mp4", {}, 200),
        ("mp4_8k_header", "video/mp4", {}, 413),
        ("mkv_3000_frames", "video/x-matroska", {}, 200),
        ("mjpeg_3000_frames", "video/jpeg", {}, 400),
    ],
)
async def test_video_bombs_decode_at_most_the_configured_frames(
    make_client: Any, videos: dict[str, bytes], name: str, mime: str, settings: dict, expected: int
) -> None:
    client = await make_client(max_tokens=2, max_video_frames=4, **settings)
    before = await _frames_kept(client)
    part = {"type": "video_url", "video_url": {"url": data_url(videos[name], mime)}}
    rss0 = rss_bytes()
    status, seconds, text = await _post(client, part)
    kept = await _frames_kept(client) - before
    print(
        f"\n{name} {settings}: {status} in {seconds * 1000:.0f} ms, frames kept {kept:.0f}, "
        f"RSS +{(rss_bytes() - rss0) / MiB:.1f} MiB"
    )
    assert status == expected, text[:300]
    assert kept <= 4
    assert seconds < (1.0 if status >= 400 else 10.0)
    assert not leaks(text)


async def test_video_b64_of_many_jpegs_in_input_video_is_refused(make_client: Any) -> None:
    client = await make_client(max_tokens=2)
    raw = base64.b64encode(pil_bytes("JPEG", (16, 16)) * 5000).decode()
    status, seconds, text = await _post(client, {"type": "input_video", "b64_json": raw})
    assert 400 <= status < 500 and seconds < 1.0, (status, seconds, text[:200])
