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
PAGES = 4096


def _faults_under(policy: str, sizes: list[tuple[int, bool]]) -> list[float]:
    """Page faults per round in a fresh process that set ``policy`` as the server does."""
    code = (
        "import json, sys\n"
        "from vlmserve.media.workers import memory\n"
        "from vlmserve.testing.memory import page_faults\n"
        f"assert memory.return_large_buffers(memory.{policy})\n"
        "print(json.dumps([page_faults(s, thread=t) for s, t in json.loads(sys.argv[1])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(sizes)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_the_api_process_keeps_photo_bodies_mapped_and_gives_large_buffers_back() -> None:
    body_main, body_thread, large = _faults_under(
        "API", [(PHOTO_BODY, False), (PHOTO_BODY, True), (LARGE, False)]
    )
    assert body_main < 20 and body_thread < 20  # reused from the heap: no page faulted anew
    assert large >= 5 * LARGE / PAGES * 0.9  # unmapped when freed: every page again


async def test_a_media_worker_keeps_a_photos_buffers_between_images() -> None:
    pool = MediaPool(1, nice=0)
    await pool.start()
    try:
        faults = await pool.run(page_faults, PHOTO_PIXELS)
    finally:
        pool.close()
    assert faults < 50  # 5 buffers of 3.7 MB faulted in anew would be ~4,500


def test_a_process_without_the_policy_faults_photo_buffers_in_anew() -> None:
    """What the worker's policy saves, measured the same way: the API policy's mappings."""
    (pixels,) = _faults_under("API", [(PHOTO_PIXELS, False)])
    assert pixels >= 5 * PHOTO_PIXELS / PAGES * 0.9
