"""Images to the engine process through shared memory (``engine/proc/pixels.py``): the
``prepare`` message pickles block names, not pixels; the engine gets the very same pixels;
no block outlives its request, whether the engine took it, never did, or the request was
cancelled while its pixels were being written."""

from __future__ import annotations

import asyncio
import os
import pickle
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
from vlmserve.media.workers.shared import SharedImage
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
    shipped, names = pixels.ship(request)
    try:
        assert len(names) == 4 and all(_exists(n) for n in names)
        assert len(pickle.dumps(shipped)) < 4096  # 3.7 MB of pixels travel outside the pickle
        assert isinstance(request.messages[0].content[0], ImagePart)  # the original is intact
        assert request.messages[0].content[0].image is photo
        taken = pixels.receive(pickle.loads(pickle.dumps(shipped)))
    finally:
        pixels.release(names)
    image, video, text = taken.messages[0].content
    assert isinstance(image, ImagePart) and image.image.tobytes() == photo.tobytes()
    assert image.image.size == photo.size and image.image.mode == photo.mode
    assert isinstance(video, VideoPart) and video.fps == 2.0 and video.frame_indices == [0, 5, 9]
    assert [f.tobytes() for f in video.frames] == [f.tobytes() for f in frames]
    assert text == TextPart("what is this?")
    assert taken.sampling == request.sampling and taken.request_id == "r1"
    assert not any(_exists(n) for n in names)  # the engine unlinked what it took


def test_a_request_without_media_is_not_shipped() -> None:
    request = _request()
    assert not pixels.has_media(request)
    assert pixels.has_media(_request(ImagePart(gradient_image(8, 8))))


def test_blocks_the_engine_never_took_are_unlinked_by_release() -> None:
    """The engine process died, or the request was cancelled before it read them."""
    shipped, names = pixels.ship(_request(ImagePart(gradient_image(64, 48))))
    assert all(_exists(n) for n in names)
    pixels.release(names)
    assert not any(_exists(n) for n in names)
    with pytest.raises(ServiceUnavailable, match="gone before the engine read them"):
        pixels.receive(shipped)
    pixels.release(names)  # twice is harmless


def test_an_image_gone_midway_still_unlinks_the_rest() -> None:
    parts = [ImagePart(gradient_image(32, 32, seed=i)) for i in range(3)]
    shipped, names = pixels.ship(_request(*parts))
    pixels.release(names[1:2])
    with pytest.raises(ServiceUnavailable):
        pixels.receive(shipped)
    assert not any(_exists(n) for n in names)
    pixels.release(names)


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
    _, names = pixels.ship(_request(ImagePart(gradient_image(16, 16))))
    try:
        assert all(os.stat(f"/dev/shm/{n}").st_mode & 0o077 == 0 for n in names)
    finally:
        pixels.release(names)


async def test_pixels_are_shipped_on_the_threads_given_at_their_priority() -> None:
    """The API process's copy into shared memory is media work: it runs on the engine
    client's threads, ``media_nice`` below the request path."""
    base = thread_nice()
    seen: list[int] = []
    with low_priority_executor(1, 3, "test-ship") as executor:
        executor.submit(lambda: seen.append(thread_nice())).result()
        request = _request(ImagePart(gradient_image(64, 48, seed=1)))
        shipped, names = await pixels.shipped(request, executor)
    try:
        assert seen == [min(19, base + 3)] and thread_nice() == base
        assert [s.name for s in _blocks(shipped)] == names and all(map(_exists, names))
    finally:
        pixels.release(names)
    client = EngineProcClient("tiny", dict, media_nice=4)
    assert client._shipper.submit(thread_nice).result() == min(19, base + 4)
