"""glibc's thresholds for large buffers, per process: the API process keeps a photo body's
buffers for the next request and gives back large ones; a media worker keeps a photo's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlmserve.media.workers import MediaPool
from vlmserve.testing.memory import page_faults

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PHOTO_BODY = 180_000  # a 1280x960 JPEG's data URL
PHOTO_PIXELS = 1280 * 960 * 3
LARGE = 4 * 1024 * 1024


def _measured_under(policy: str, measures: list[str]) -> list[float]:
    """``measures`` (calls of ``vlmserve.testing.memory``'s functions) in a fresh process that
    set ``policy`` as the server does."""
    code = (
        "import json\n"
        "from vlmserve.media.workers import memory\n"
        "from vlmserve.testing.memory import page_faults, rss_given_back\n"
        f"assert memory.set_malloc_policy(memory.{policy})\n"
        f"print(json.dumps([{', '.join(measures)}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(x) for x in json.loads(out.stdout)]


def test_the_api_process_keeps_photo_bodies_mapped_and_gives_large_buffers_back() -> None:
    body_main, body_thread, given_back = _measured_under(
        "API",
        [
            f"page_faults({PHOTO_BODY})",
            f"page_faults({PHOTO_BODY}, thread=True)",
            f"rss_given_back({LARGE})",
        ],
    )
    assert body_main < 20 and body_thread < 20  # reused from the heap: no page faulted anew
    assert given_back > 0.9  # each in a mapping of its own, unmapped when freed


async def test_a_media_worker_keeps_a_photos_buffers_between_images() -> None:
    pool = MediaPool(1, nice=0)
    await pool.start()
    try:
        faults = await pool.run(page_faults, PHOTO_PIXELS)
    finally:
        pool.close()
    assert faults < 50  # 5 buffers of 3.7 MB faulted in anew would be ~4,500
