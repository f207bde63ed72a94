"""Images preprocessed in the engine process's worker processes (``engine/hf/preprocess.py``):
the same bytes as in process, the block read there and not here, and a killed worker costs
nothing but a restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from _posixshmem import shm_unlink  # type: ignore[import-not-found]
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

from vlmserve.engine.hf.preprocess import PreprocessPool
from vlmserve.engine.hf.processor_cache import CachedImageProcessor, image_key
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.shared import LentImage, release_block, write_block
from vlmserve.testing.media import gradient_image

KWARGS = {"return_tensors": "pt"}


def _ready(pool: PreprocessPool, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pool.ready:
        assert time.monotonic() < deadline, "the preprocessing workers did not start"
        time.sleep(0.05)


def _blocks() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vlmserve_px_")}


def _signal_workers(
    pool: PreprocessPool, sig: signal.Signals, processor: CachedImageProcessor, image: LentImage
) -> dict:
    """``sig`` to every worker of ``pool``, then one image through ``processor``."""
    executor = pool._executor
    assert executor is not None
    for pid in list(executor._processes):
        os.kill(pid, sig)
    time.sleep(0.5)
    return processor([image], **KWARGS)


@pytest.fixture(scope="module")
def inner(tiny_dir: Path) -> object:
    return AutoProcessor.from_pretrained(tiny_dir).image_processor


@pytest.fixture
def lent() -> Iterator[tuple[LentImage, object]]:
    """A photo in a block, as the engine process sees it, and the photo itself."""
    photo = gradient_image(640, 480, seed=5)
    shared = write_block(photo)
    yield LentImage(shared), photo
    release_block(shared.name)


def test_a_lent_image_is_keyed_as_the_same_pixels_read_here(
    lent: tuple[LentImage, object],
) -> None:
    image, photo = lent
    options = repr(sorted(KWARGS.items()))
    assert image_key(image, options) == image_key(photo, options)
    assert image._im is None
    other = gradient_image(640, 480, seed=6)
    assert image_key(other, options) != image_key(photo, options)
    assert image_key(photo, "other options") != image_key(photo, options)


def test_workers_preprocess_bit_identically_and_outlive_a_killed_one(
    inner: object, lent: tuple[LentImage, object]
) -> None:
    """One pool through its life (each start is a process with torch: seconds)."""
    image, photo = lent
    local = inner([photo], **KWARGS)
    pool = PreprocessPool(inner, workers=2, nice=0)
    cached = CachedImageProcessor(inner, 1 << 30)
    cached.remote = pool
    assert pool._executor is None  # nothing spawned before an image comes
    assert pool(image.shared, KWARGS) is None  # the first one starts them; it is done here
    try:
        assert not cached.preprocessed_elsewhere()  # not up yet
        _ready(pool)
        assert len(pool._executor._processes) == 2  # every worker, not one doing it all
        assert cached.preprocessed_elsewhere()
        blocks = _blocks()
        out = cached([image], **KWARGS)
        assert pool.done == 1  # a worker did it
        assert _blocks() == blocks  # its patch rows' block mapped here and unlinked
        assert image._im is None  # and this process never read the pixels
        assert torch.equal(out["pixel_values"], local["pixel_values"])
        assert torch.equal(out["image_grid_thw"], local["image_grid_thw"])
        again = cached([image], **KWARGS)  # a cache hit: no worker, no read
        assert pool.done == 1 and image._im is None
        assert torch.equal(again["pixel_values"], local["pixel_values"])

        # an option that cannot be pickled stays here; the pool is unharmed
        assert pool(image.shared, {**KWARGS, "unpicklable": lambda: None}) is None
        assert pool.ready

        # Ctrl-C on the terminal reaches the workers too: the engine stops them itself
        uncached = CachedImageProcessor(inner, 0)  # every call preprocesses
        uncached.remote = pool
        out = _signal_workers(pool, signal.SIGINT, uncached, image)
        assert torch.equal(out["pixel_values"], local["pixel_values"])
        assert pool.restarts == 0 and pool.done == 2

        # a worker killed with SIGKILL (as the OOM killer would): that image is done here,
        # with the same bytes, and the pool is restarted
        out = _signal_workers(pool, signal.SIGKILL, uncached, image)
        assert torch.equal(out["pixel_values"], local["pixel_values"])
        assert pool.restarts == 1 and pool.done == 2
        _ready(pool)
        uncached([image], **KWARGS)
        assert pool.done == 3  # the new pool takes images again

        # a block gone before the worker read it (the request was cancelled): a 503
        shm_unlink(f"/{image.shared.name}")  # (the fixture's release is then a no-op)
        with pytest.raises(ServiceUnavailable) as err:
            pool(image.shared, KWARGS)
        assert err.value.code == "media_gone"
    finally:
        pool.close()
    assert pool(image.shared, KWARGS) is None  # closed: the engine process does it


def test_the_pools_threads_keep_the_engines_priority_whoever_starts_it(
    inner: object, lent: tuple[LentImage, object]
) -> None:
    """The first image comes from a media thread ``nice`` below the engine; the executor's
    own threads (they take the GIL) still run at the engine's priority, the workers below."""
    image, _ = lent
    pool = PreprocessPool(inner, workers=1, nice=10)
    engine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def media_thread() -> None:
        os.nice(10)  # this thread only (Linux)
        assert pool(image.shared, KWARGS) is None

    first = threading.Thread(target=media_thread)
    first.start()
    first.join()
    try:
        _ready(pool)
        executor = pool._executor
        assert executor is not None
        helpers = [executor._executor_manager_thread, executor._call_queue._thread]
        niceness = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in helpers]
        assert niceness == [engine, engine]
        workers = [os.getpriority(os.PRIO_PROCESS, pid) for pid in executor._processes]
        assert workers == [min(19, engine + 20)]
    finally:
        pool.close()
