"""Without media workers, decodes still yield the cores to the request path: they run on
threads ``media_worker_nice`` below the event loop's priority (``media/workers/priority.py``)."""

from __future__ import annotations

import threading

from vlmserve.api.common.media_reader import MediaReader
from vlmserve.config import Settings
from vlmserve.media.workers.priority import thread_nice
from vlmserve.testing.media import data_url, image_bytes


def _where(data: bytes) -> tuple[str, int, int]:
    return threading.current_thread().name, thread_nice(), len(data)


async def test_an_in_process_decode_runs_below_the_event_loops_priority() -> None:
    reader = MediaReader.from_settings(Settings(device="cpu", media_worker_nice=6))
    data = image_bytes()
    (name, nice, size), read = await reader._read_decode(
        "image", data_url(data, "image/png"), _where
    )
    assert name.startswith("vlmserve-media-decode")
    assert nice == min(19, thread_nice() + 6) > thread_nice()
    assert size == read == len(data)
