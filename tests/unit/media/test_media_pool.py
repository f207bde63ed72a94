"""Media workers, real processes: the same decode as in-process, pixels left in shared memory
for their reader, a worker killed mid-call replaced and its call retried once, then a clear 503."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator

import pytest
from PIL import Image

from vlmserve.errors import MediaError, ServiceUnavailable
from vlmserve.media import MediaPolicy, decode_image, decode_video
from vlmserve.media.workers import MediaPool, read_and_decode
from vlmserve.media.workers.priority import low_priority_executor, lower_this_thread, thread_nice
from vlmserve.media.workers.shared import BlockImage
from vlmserve.testing.media import image_bytes, mp4_bytes

POLICY = MediaPolicy()


def _shared_blocks(nbytes: int) -> set[str]:
    """Shared memory blocks of ``nbytes`` (other processes on the machine make their own)."""
    names = set()
    for name in os.listdir("/dev/shm"):
        with contextlib.suppress(OSError):
            if name.startswith("vlmserve_px_") and os.stat(f"/dev/shm/{name}").st_size == nbytes:
                names.add(name)
    return names


@pytest.fixture
async def pool() -> AsyncIterator[MediaPool]:
    pool = MediaPool(1, nice=0)
    await pool.start()
    yield pool
    pool.close()


async def test_an_image_decoded_in_a_worker_is_the_same_pixels_as_in_process(
    pool: MediaPool,
) -> None:
    data = image_bytes(320, 200, fmt="JPEG", seed=3)
    source = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    blocks = _shared_blocks(320 * 200 * 3)
    image, size = await pool.run(read_and_decode, source, POLICY, "image", decode_image, POLICY)
    local = decode_image(data, POLICY)
    assert isinstance(image, BlockImage)  # not copied out: the pixels are in the worker's block
    assert _shared_blocks(320 * 200 * 3) - blocks == {image.shared.name}
    assert size == len(data)
    assert (image.mode, image.size) == (local.mode, local.size)
    assert image.tobytes() == local.tobytes()
    assert _shared_blocks(320 * 200 * 3) == blocks  # read here and lent to nobody: unlinked


async def test_video_frames_come_back_with_their_timing(pool: MediaPool) -> None:
    data = mp4_bytes()
    source = "data:video/mp4;base64," + base64.b64encode(data).decode()
    video, _ = await pool.run(read_and_decode, source, POLICY, "video", decode_video, POLICY)
    local = decode_video(data, POLICY)
    assert video.frame_indices == local.frame_indices and video.fps == local.fps
    assert [f.tobytes() for f in video.frames] == [f.tobytes() for f in local.frames]


async def test_a_decode_error_in_a_worker_is_the_same_400(pool: MediaPool) -> None:
    with pytest.raises(MediaError, match="not a recognised image"):
        await pool.run(decode_image, b"not an image at all", POLICY)


async def test_a_worker_killed_mid_call_is_replaced_and_the_call_retried(pool: MediaPool) -> None:
    (pid,) = pool.pids()
    call = asyncio.create_task(pool.run(time.sleep, 1.0))
    await asyncio.sleep(0.3)  # the worker is inside the call
    os.kill(pid, signal.SIGKILL)
    assert await asyncio.wait_for(call, 30) is None  # the retry ran on a fresh worker
    assert pool.replaced == 1 and pool.pids() != [pid]
    source = base64.b64encode(image_bytes()).decode()
    image, _ = await pool.run(read_and_decode, source, POLICY, "image", decode_image, POLICY)
    assert image.size == (64, 64)


async def test_ctrl_c_on_the_terminal_leaves_the_workers_to_the_server(pool: MediaPool) -> None:
    """SIGINT reaches every process of the group; the server stops its workers itself, so a
    worker mid-decode finishes its call and stays."""
    (pid,) = pool.pids()
    call = asyncio.create_task(pool.run(time.sleep, 0.5))
    await asyncio.sleep(0.2)  # the worker is inside the call
    os.kill(pid, signal.SIGINT)
    try:
        assert await asyncio.wait_for(call, 30) is None
    except KeyboardInterrupt:  # the worker's, sent back as the call's error
        pytest.fail("the worker took the terminal's Ctrl-C mid-call")
    assert pool.pids() == [pid] and pool.replaced == 0


async def test_a_replaced_pool_has_all_its_workers_again_under_one_call_at_a_time() -> None:
    pool = MediaPool(2, nice=0)
    try:
        assert len(await pool.start()) == 2 and len(pool.pids()) == 2
        os.kill(pool.pids()[0], signal.SIGKILL)
        for _ in range(4):  # the first call finds the pool broken and retries on a new one
            assert await pool.run(sum, [1, 2]) == 3
            await asyncio.sleep(0.1)  # each call's worker idle again before the next
        assert pool.replaced == 1
        deadline = time.monotonic() + 60
        while len(pool.pids()) < 2:  # both spawned, not one doing every call
            assert time.monotonic() < deadline, pool.pids()
            await asyncio.sleep(0.1)
    finally:
        pool.close()


async def test_a_call_whose_worker_dies_twice_is_a_503_and_the_next_call_succeeds(
    pool: MediaPool,
) -> None:
    with pytest.raises(ServiceUnavailable, match="media worker process died") as caught:
        await pool.run(os._exit, 9)
    assert caught.value.status_code == 503 and caught.value.retry_after >= 1
    assert pool.replaced == 2
    assert await pool.run(sum, [1, 2, 3]) == 6


def _late_image(seconds: float) -> Image.Image:
    time.sleep(seconds)
    return Image.new("RGB", (64, 64), (1, 2, 3))


async def test_a_call_given_up_while_it_runs_leaves_no_shared_memory_behind(
    pool: MediaPool,
) -> None:
    blocks = _shared_blocks(64 * 64 * 3)
    call = asyncio.create_task(pool.run(_late_image, 0.5))
    await asyncio.sleep(0.2)  # the worker is inside the call
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    image = await pool.run(_late_image, 0)  # after the abandoned one, in the one worker
    assert image.getpixel((0, 0)) == (1, 2, 3)
    await asyncio.sleep(0.1)
    assert _shared_blocks(64 * 64 * 3) == blocks


async def test_close_stops_every_worker_even_one_mid_decode() -> None:
    pool = MediaPool(2, nice=0)
    pids = await pool.start()
    busy = asyncio.ensure_future(pool.run(time.sleep, 30.0))  # a decode that would outlive us
    await asyncio.sleep(0.3)
    started = time.monotonic()
    pool.close(grace=0.5)
    assert time.monotonic() - started < 5
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped: not a zombie either
    busy.cancel()
    with contextlib.suppress(BaseException):
        await busy
    with pytest.raises(ServiceUnavailable, match="shutting down"):
        await pool.run(time.sleep, 0)


def _nice_now() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_workers_run_below_the_request_path() -> None:
    """Under an image flood the cores go to the request path first: decodes in the workers
    run ``nice`` lower, the event loop does not."""
    base = thread_nice()
    pool = MediaPool(1, nice=4)
    try:
        assert await pool.run(_nice_now) == min(19, base + 4)
        assert thread_nice() == base
    finally:
        pool.close()


def test_a_low_priority_thread_lowers_itself_only_up_to_19() -> None:
    base = thread_nice()
    with low_priority_executor(1, 3, "test-low") as executor:
        assert executor.submit(thread_nice).result() == min(19, base + 3)
        assert executor.submit(lower_this_thread, 40).result() == 19
    with low_priority_executor(1, 0, "test-same") as executor:
        assert executor.submit(thread_nice).result() == base
    assert thread_nice() == base
