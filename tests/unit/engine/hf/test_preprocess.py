"""Images preprocessed in the engine process's worker processes (``engine/hf/preprocess.py``):
the same bytes as in process, the block read there and not here, and a killed worker costs
nothing but a restart."""

from __future__ import annotations

import os
import signal
import time
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


@pytest.fixture(scope="module")
def inner(tiny_dir: Path) -> object:
    return AutoProcessor.from_pretrained(tiny_dir).image_processor


@pytest.fixture(scope="module")
def pool(inner: object) -> Iterator[PreprocessPool]:
    pool = PreprocessPool(inner, workers=1, nice=0)
    pool.start()
    _ready(pool)
    yield pool
    pool.close()


@pytest.fixture
def lent() -> Iterator[tuple[LentImage, object]]:
    """A photo in a block, as the engine process sees it, and the photo itself."""
    photo = gradient_image(640, 480, seed=5)
    shared = write_block(photo)
    yield LentImage(shared), photo
    release_block(shared.name)


def test_a_workers_preprocessing_is_bit_identical_and_never_reads_the_block_here(
    inner: object, pool: PreprocessPool, lent: tuple[LentImage, object]
) -> None:
    image, photo = lent
    cached = CachedImageProcessor(inner, 1 << 30)
    cached.remote = pool
    done = pool.done
    out = cached([image], **KWARGS)
    assert pool.done == done + 1  # a worker did it
    assert image._im is None  # and this process never read the pixels
    local = inner([photo], **KWARGS)
    assert torch.equal(out["pixel_values"], local["pixel_values"])
    assert torch.equal(out["image_grid_thw"], local["image_grid_thw"])
    again = cached([image], **KWARGS)  # a hit: no worker, no read
    assert pool.done == done + 1 and image._im is None
    assert torch.equal(again["pixel_values"], local["pixel_values"])


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


def test_an_image_gone_before_the_worker_read_it_is_a_503(
    pool: PreprocessPool, lent: tuple[LentImage, object]
) -> None:
    image, _ = lent
    release_block(image.shared.name)  # the request was cancelled meanwhile
    with pytest.raises(ServiceUnavailable) as err:
        pool(image.shared, KWARGS)
    assert err.value.code == "media_gone"


def test_a_killed_worker_costs_one_image_done_here_and_a_restart(
    inner: object, lent: tuple[LentImage, object]
) -> None:
    image, photo = lent
    pool = PreprocessPool(inner, workers=1, nice=0)
    pool.start()
    try:
        _ready(pool)
        cached = CachedImageProcessor(inner, 0)  # no cache: every call preprocesses
        cached.remote = pool
        cached([image], **KWARGS)
        assert pool.done == 1
        executor = pool._executor
        assert executor is not None
        for pid in list(executor._processes):  # kill -9, as the OOM killer would
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        out = cached([image], **KWARGS)  # done in this process: the same answer
        assert torch.equal(out["pixel_values"], inner([photo], **KWARGS)["pixel_values"])
        assert pool.restarts == 1 and pool.done == 1
        _ready(pool)
        cached([image], **KWARGS)
        assert pool.done == 2  # the new pool takes images again
    finally:
        pool.close()
    assert pool(image.shared, KWARGS) is None  # closed: this process does it
