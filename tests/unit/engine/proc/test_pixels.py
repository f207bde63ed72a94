"""Images to the engine process through shared memory (``engine/proc/pixels.py``): the
``prepare`` message pickles block names, not pixels; the engine gets the very same pixels;
a media worker's block is lent as it is (no copy in the API process); no block outlives its
request, whether the engine read it, never did, or the request was cancelled while its pixels
were being written; a block is unlinked once, by the API process, never by the engine."""

from __future__ import annotations

import asyncio
import os
import pickle
from _posixshmem import shm_unlink
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from vlmserve.engine.proc import pixels
from vlmserve.engine.proc.client import EngineProcClient
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.priority import low_priority_executor, thread_nice
from vlmserve.media.workers.shared import (
    BlockImage,
    LentImage,
    SharedImage,
    held,
    pixel_digest,
    to_shared,
)
from vlmserve.testing.media import gradient_image


def _request(*parts: object) -> GenerateRequest:
    messages = [ChatMessage("user", [*parts, TextPart("what is this?")])]  # type: ignore[list-item]
    return GenerateRequest("r1", messages, SamplingParams(max_tokens=4))


def _blocks(request: GenerateRequest) -> list[SharedImage]:
    out: list[SharedImage] = []
    for part in request.messages[0].content:
        if isinstance(part, ImagePart):
            out.append(part.image)  # type: ignore[arg-type]
        elif isinstance(part, VideoPart):
            out.extend(part.frames)  # type: ignore[arg-type]
    return out


def _exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


def test_a_photo_crosses_as_block_names_and_arrives_with_the_same_pixels() -> None:
    photo = gradient_image(1280, 960, seed=3)
    frames = [gradient_image(96, 64, seed=i) for i in range(3)]
    request = _request(ImagePart(photo), VideoPart(frames, fps=2.0, frame_indices=[0, 5, 9]))
    shipped, blocks = pixels.ship(request)
    names = blocks.names
    try:
        assert len(names) == 4 and all(_exists(n) for n in names)
        assert len(pickle.dumps(shipped)) < 4096  # 3.7 MB of pixels travel outside the pickle
        assert isinstance(request.messages[0].content[0], ImagePart)  # the original is intact
        assert request.messages[0].content[0].image is photo
        taken = pixels.receive(pickle.loads(pickle.dumps(shipped)))
        image, video, text = taken.messages[0].content
        assert isinstance(image, ImagePart) and isinstance(image.image, LentImage)
        assert image.image.size == photo.size and image.image.mode == photo.mode
        # keyed by content without a read: the digest its writer made of the same pixels
        assert image.image.pixel_digest == pixel_digest(photo.tobytes())
        assert image.image.tobytes() == photo.tobytes()  # read while the API holds the block
        assert isinstance(video, VideoPart) and video.fps == 2.0
        assert video.frame_indices == [0, 5, 9]
        assert [f.tobytes() for f in video.frames] == [f.tobytes() for f in frames]
        assert all(_exists(n) for n in names)  # the engine only reads
    finally:
        pixels.release(blocks)
    assert text == TextPart("what is this?")
    assert taken.sampling == request.sampling and taken.request_id == "r1"
    assert not any(_exists(n) for n in names)  # the API process unlinked them


def test_an_image_read_after_its_block_is_gone_is_a_503_not_a_crash() -> None:
    shipped, blocks = pixels.ship(_request(ImagePart(gradient_image(64, 48, seed=1))))
    taken = pixels.receive(shipped)
    pixels.release(blocks)  # the request was cancelled before the engine read the pixels
    image = taken.messages[0].content[0].image
    with pytest.raises(ServiceUnavailable) as err:
        image.tobytes()
    assert err.value.code == "media_gone"


def test_a_request_without_media_is_not_shipped() -> None:
    request = _request()
    assert not request.has_media
    assert _request(ImagePart(gradient_image(8, 8))).has_media


def test_blocks_the_engine_never_took_are_unlinked_by_release() -> None:
    """The engine process died, or the request was cancelled before it read them."""
    shipped, blocks = pixels.ship(_request(ImagePart(gradient_image(64, 48))))
    names = blocks.names
    assert all(_exists(n) for n in names)
    pixels.release(blocks)
    assert not any(_exists(n) for n in names)
    with pytest.raises(ServiceUnavailable, match="gone before the engine read them"):
        pixels.receive(shipped)
    pixels.release(blocks)  # twice is harmless


def test_an_image_gone_midway_is_a_503_and_release_unlinks_the_rest() -> None:
    parts = [ImagePart(gradient_image(32, 32, seed=i)) for i in range(3)]
    shipped, blocks = pixels.ship(_request(*parts))
    names = blocks.names
    shm_unlink(f"/{names[1]}")  # gone underneath (not the API process's release)
    with pytest.raises(ServiceUnavailable, match="1 of the request's images"):
        pixels.receive(shipped)
    pixels.release(blocks)
    assert not any(_exists(n) for n in names)


def test_a_request_cancelled_while_its_pixels_are_written_leaves_no_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    put = pixels._put

    def recorded(image: Image.Image) -> SharedImage:
        shared = put(image)
        made.append(shared.name)
        return shared

    monkeypatch.setattr(pixels, "_put", recorded)
    request = _request(*[ImagePart(gradient_image(1280, 960, seed=i)) for i in range(4)])

    async def cancelled() -> None:
        task = asyncio.ensure_future(pixels.shipped(request))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the thread finishes its copy, then its blocks go
            if len(made) == 4 and not any(_exists(n) for n in made):
                return
            await asyncio.sleep(0.05)

    asyncio.run(cancelled())
    assert len(made) == 4, made
    assert not any(_exists(n) for n in made), [n for n in made if _exists(n)]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")
def test_shipped_blocks_are_private_to_the_user() -> None:
    _, blocks = pixels.ship(_request(ImagePart(gradient_image(16, 16))))
    try:
        assert all(os.stat(f"/dev/shm/{n}").st_mode & 0o077 == 0 for n in blocks.names)
    finally:
        pixels.release(blocks)


async def test_pixels_are_shipped_on_the_threads_given_at_their_priority() -> None:
    """The API process's copy into shared memory is media work: it runs on the engine
    client's threads, ``media_nice`` below the request path."""
    base = thread_nice()
    seen: list[int] = []
    with low_priority_executor(1, 3, "test-ship") as executor:
        executor.submit(lambda: seen.append(thread_nice())).result()
        request = _request(ImagePart(gradient_image(64, 48, seed=1)))
        shipped, blocks = await pixels.shipped(request, executor)
    try:
        assert seen == [min(19, base + 3)] and thread_nice() == base
        assert [s.name for s in _blocks(shipped)] == blocks.names
        assert all(map(_exists, blocks.names))
    finally:
        pixels.release(blocks)
    client = EngineProcClient("tiny", dict, media_nice=4)
    assert client._shipper.submit(thread_nice).result() == min(19, base + 4)


def _from_worker(image: Image.Image) -> BlockImage:
    """As a media worker's result reaches the API process."""
    out = held(to_shared(image))
    assert isinstance(out, BlockImage)
    return out


def _no_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(image: Image.Image) -> SharedImage:
        raise AssertionError("a media worker's pixels were copied into a new block")

    monkeypatch.setattr(pixels, "_put", refuse)


async def test_a_media_workers_block_is_lent_to_the_engine_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photo, frames = (
        gradient_image(320, 240, seed=7),
        [gradient_image(48, 32, seed=i) for i in (1, 2)],
    )
    image, video = _from_worker(photo), [_from_worker(f) for f in frames]
    request = _request(ImagePart(image), VideoPart(video, fps=1.0))
    _no_copies(monkeypatch)
    shipped, blocks = await pixels.shipped(request, _Refusing())  # no copy: no thread either
    names = [image.shared.name, *(f.shared.name for f in video)]
    assert blocks.made == [] and blocks.names == names
    assert [s.name for s in _blocks(shipped)] == names
    taken = pixels.receive(pickle.loads(pickle.dumps(shipped)))
    got_image, got_video, _ = taken.messages[0].content
    assert isinstance(got_image, ImagePart) and isinstance(got_image.image, LentImage)
    assert got_image.image.shared.name == image.shared.name  # the worker's block, named
    assert got_image.image.pixel_digest == pixel_digest(photo.tobytes())
    assert got_image.image.tobytes() == photo.tobytes()
    assert isinstance(got_video, VideoPart)
    assert [f.tobytes() for f in got_video.frames] == [f.tobytes() for f in frames]
    pixels.release(blocks)
    assert all(map(_exists, names))  # the images still live (this request, the uuid cache)
    del request, image, video, got_image, got_video, taken, shipped
    assert not any(map(_exists, names))  # and go with them


def test_one_image_in_two_requests_outlives_the_first_ones_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The media-by-reference cache hands one decoded part to several requests."""
    photo = gradient_image(64, 48, seed=9)
    image = _from_worker(photo)
    _no_copies(monkeypatch)
    _, first_blocks = pixels.ship(_request(ImagePart(image)))
    second, second_blocks = pixels.ship(_request(ImagePart(image)))
    pixels.release(first_blocks)
    pixels.release(first_blocks)  # twice is harmless: one loan ended, once
    assert image._lent == 1  # type: ignore[attr-defined]
    assert pixels.receive(second).messages[0].content[0].image.tobytes() == photo.tobytes()
    pixels.release(second_blocks)
    assert _exists(image.shared.name)


def test_an_image_read_in_the_api_process_meanwhile_keeps_its_block_for_the_engine() -> None:
    """An embedding or rerank of the same cached image reads its pixels while the engine
    process has not read the block yet: the block stays until the engine's loan ends."""
    photo = gradient_image(64, 48, seed=11)
    image = _from_worker(photo)
    shipped, blocks = pixels.ship(_request(ImagePart(image)))
    assert image.tobytes() == photo.tobytes()
    assert pixels.receive(shipped).messages[0].content[0].image.tobytes() == photo.tobytes()
    name = image.shared.name
    pixels.release(blocks)
    assert not _exists(name) and not image.held  # read here, lent to nobody: gone now
    again, blocks = pixels.ship(_request(ImagePart(image)))  # then it is copied, as any image
    try:
        assert len(blocks.made) == 1 and blocks.lent == []
        assert pixels.receive(again).messages[0].content[0].image.tobytes() == photo.tobytes()
    finally:
        pixels.release(blocks)


class _Refusing(ThreadPoolExecutor):
    def submit(self, *args: object, **kwargs: object) -> Future[object]:  # type: ignore[override]
        raise AssertionError("shipped used a thread for a request that needs no copy")
