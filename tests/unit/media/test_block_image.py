"""A media worker's decoded image in the API process (``media/workers/shared.py``): a PIL image
whose pixels stay in the worker's shared memory block until something reads them, equal to
the decoded image in every way a consumer looks at it; its block is unlinked exactly once,
when it is read and lent to nobody, when its last loan ends after a read, or when the image
is garbage; never while lent."""

from __future__ import annotations

import errno
import gc
import os
import pickle
from _posixshmem import shm_unlink
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers import shared
from vlmserve.media.workers.shared import BlockImage, SharedImage, held, read_block
from vlmserve.testing.media import gradient_image


def _exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the blocks unlinked, one entry per unlink."""
    names: list[str] = []
    unlink = shared.release_block

    def counted(name: str) -> None:
        names.append(name)
        unlink(name)

    monkeypatch.setattr(shared, "release_block", counted)
    yield names


def _block_image(image: Image.Image) -> BlockImage:
    """As the pool hands it over: the worker's ``to_shared``, then ``held``."""
    out = held(shared.to_shared(image))
    assert isinstance(out, BlockImage)
    return out


def test_size_mode_and_bands_need_no_read(released: list[str]) -> None:
    photo = gradient_image(321, 123, seed=2)
    image = _block_image(photo)
    assert (image.size, image.mode, image.getbands()) == (photo.size, "RGB", ("R", "G", "B"))
    assert (image.width, image.height) == (321, 123) and isinstance(image, Image.Image)
    assert image.held and _exists(image.shared.name) and released == []


def test_every_read_sees_the_decoded_pixels() -> None:
    photo = gradient_image(97, 61, seed=5)
    for read in (
        lambda im: im.tobytes(),
        lambda im: np.asarray(im).tobytes(),
        lambda im: im.convert("L").tobytes(),
        lambda im: im.resize((40, 30), Image.Resampling.BICUBIC).tobytes(),
        lambda im: im.crop((3, 4, 50, 60)).tobytes(),
        lambda im: im.copy().tobytes(),
        lambda im: im.getpixel((7, 9)),
        lambda im: pickle.loads(pickle.dumps(im)).tobytes(),
    ):
        assert read(_block_image(photo)) == read(photo)


def test_a_pickled_block_image_is_a_plain_image() -> None:
    image = pickle.loads(pickle.dumps(_block_image(gradient_image(8, 8))))
    assert type(image) is Image.Image and image.size == (8, 8)


def test_read_and_lent_to_nobody_the_block_goes_at_once(released: list[str]) -> None:
    image = _block_image(gradient_image(64, 48, seed=1))
    name = image.shared.name
    image.load()
    assert released == [name] and not _exists(name) and not image.held
    image.tobytes()
    assert image.lend() is None  # the pixels are here now: a reader elsewhere gets a copy
    del image
    gc.collect()
    assert released == [name]  # once


def test_an_image_never_read_frees_its_block_when_it_is_garbage(released: list[str]) -> None:
    image = _block_image(gradient_image(64, 48, seed=1))
    name = image.shared.name
    del image
    assert released == [name] and not _exists(name)


def test_a_lent_block_stays_until_the_loan_ends_even_when_read_here(
    released: list[str],
) -> None:
    photo = gradient_image(64, 48, seed=3)
    image = _block_image(photo)
    lent = image.lend()
    assert lent == image.shared
    assert image.tobytes() == photo.tobytes()  # read here meanwhile: the block stays
    assert released == [] and read_block(lent) == photo.tobytes()
    image.give_back()
    assert released == [lent.name] and not _exists(lent.name)
    del image
    assert released == [lent.name]


def test_two_loans_of_one_image_the_block_outlives_both(released: list[str]) -> None:
    """One image in two requests (the media-by-reference cache): each lends it; ending the
    loans frees nothing while the image lives, and it goes once with the image."""
    image = _block_image(gradient_image(32, 32, seed=4))
    first, second = image.lend(), image.lend()
    assert first == second == image.shared
    image.give_back()
    image.give_back()
    assert released == [] and _exists(image.shared.name)
    name = image.shared.name
    del image
    assert released == [name]


def test_a_block_gone_underneath_is_a_clear_error_not_garbage() -> None:
    image = _block_image(gradient_image(16, 16))
    shm_unlink(f"/{image.shared.name}")  # not this process's doing: /dev/shm cleaned
    with pytest.raises(FileNotFoundError):
        image.tobytes()


def test_the_pools_result_walk_keeps_other_values() -> None:
    value = {"a": [SharedImage.put(gradient_image(4, 4)), 3], "b": ("x", None)}
    out = held(value)
    assert isinstance(out["a"][0], BlockImage) and out["a"][1] == 3 and out["b"] == ("x", None)


def test_a_closed_block_image_says_so_as_any_closed_image() -> None:
    image = _block_image(gradient_image(8, 8))
    image.close()
    with pytest.raises(ValueError, match="closed image"):
        image.tobytes()


def test_a_full_dev_shm_is_a_503_that_says_so_and_leaves_no_block(
    monkeypatch: pytest.MonkeyPatch, released: list[str]
) -> None:
    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ServiceUnavailable, match="/dev/shm") as caught:
        shared.to_shared(gradient_image(64, 48))
    assert caught.value.status_code == 503 and caught.value.code == "shared_memory_full"
    assert len(released) == 1 and not _exists(released[0])


def test_a_clip_whose_third_frame_finds_dev_shm_full_leaves_none_of_its_blocks(
    monkeypatch: pytest.MonkeyPatch, released: list[str]
) -> None:
    writes: list[int] = []
    pwrite = os.pwrite

    def full_on_the_third(fd: int, data: Any, offset: int) -> int:
        writes.append(fd)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_on_the_third)
    frames = [gradient_image(16, 16, seed=i) for i in range(4)]
    with pytest.raises(ServiceUnavailable):
        shared.to_shared({"frames": frames})
    assert len(released) == 3 and not any(map(_exists, released))
