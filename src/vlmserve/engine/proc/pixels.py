"""A request's images handed to the engine process through shared memory, not pickled.

A 1280x960 photo is 3.7 MB of pixels; pickled into the ``prepare`` message it would be
copied into the pickle, through the pipe, into the engine's receive buffer and out of it again.
Instead ``ship`` (API process) sends a copy of the ``GenerateRequest`` whose image and video
frame parts name shared memory blocks (``SharedImage``), and ``receive`` (engine process)
reads each block once into an image. An image decoded by a media worker is still in the
worker's block (a ``BlockImage``, ``media/workers/shared.py``): that block is lent to the
engine as it is, no copy in the API process. Any other image (decoded in this process, or
already read here) is written into a new block of its own.

The API process answers for every block; the engine only reads. Until the engine has answered
the ``prepare``, the request's ``Blocks`` hold them; ``release`` then unlinks the blocks made
for it and ends the loans (a worker's block goes when its last user does), whether the engine
read them, died, or the request was cancelled or refused meanwhile. A block the engine finds
gone is a 503 for a request nobody waits for. Requests without media go over as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from _posixshmem import shm_open  # type: ignore[import-not-found]
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, VideoPart
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.shared import (
    BlockImage,
    LentImage,
    SharedImage,
    release_block,
    write_block,
)

__all__ = ["Blocks", "receive", "release", "ship", "shipped"]


@dataclass(slots=True)
class Blocks:
    """The blocks a shipped request names, which the API process answers for."""

    made: list[str] = field(default_factory=list)  # written for the engine: unlinked
    lent: list[BlockImage] = field(default_factory=list)  # a media worker's: loans ended

    @property
    def names(self) -> list[str]:
        return [*self.made, *(image.shared.name for image in self.lent)]

    def release(self) -> None:
        """Once the engine has read them or never will; a second call does nothing."""
        made, lent, self.made, self.lent = self.made, self.lent, [], []
        for name in made:
            release_block(name)
        for image in lent:
            image.give_back()


def ship(request: GenerateRequest) -> tuple[GenerateRequest, Blocks]:
    """A copy of ``request`` whose pixels are in shared blocks, and those blocks."""
    blocks = Blocks()

    def put(image: Image.Image) -> SharedImage:
        if isinstance(image, BlockImage) and (shared := image.lend()) is not None:
            blocks.lent.append(image)  # the worker's block, as it is
            return shared
        shared = _put(image)
        blocks.made.append(shared.name)
        return shared

    try:
        messages = [_message(m, put) for m in request.messages]
    except BaseException:
        blocks.release()
        raise
    return dataclasses.replace(request, messages=messages), blocks


async def shipped(
    request: GenerateRequest, executor: Executor | None = None
) -> tuple[GenerateRequest, Blocks]:
    """``ship``: on the event loop when every image is still in a media worker's block (no
    copy to make), else on a thread of ``executor`` (default asyncio's; a photo's copy would
    hold the event loop); a caller cancelled meanwhile leaves no blocks behind."""
    if not _copies(request):
        return ship(request)
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(loop.run_in_executor(executor, ship, request))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(_release_shipped)
        raise


def _copies(request: GenerateRequest) -> bool:
    """Some image of ``request`` must be copied into a block of its own."""
    return not all(_in_block(image) for image in _images(request))


def _images(request: GenerateRequest) -> Iterator[Image.Image]:
    for message in request.messages:
        for part in message.content:
            if isinstance(part, ImagePart):
                yield part.image
            elif isinstance(part, VideoPart):
                yield from part.frames


def _in_block(image: Image.Image) -> bool:
    return isinstance(image, BlockImage) and image.held


def _release_shipped(work: asyncio.Future[tuple[GenerateRequest, Blocks]]) -> None:
    if not work.cancelled() and work.exception() is None:
        work.result()[1].release()


def release(blocks: Blocks) -> None:
    """The API process's share of a shipped request's blocks ends (``Blocks.release``)."""
    blocks.release()


def receive(request: GenerateRequest) -> GenerateRequest:
    """``request`` with its images as ``LentImage``s of their blocks, each block checked to
    be there (runs in the engine process)."""
    missing: list[str] = []

    def take(shared: SharedImage) -> Image.Image | None:
        try:
            return _take(shared)
        except FileNotFoundError:  # unlinked by the API process: cancelled, or it exits
            missing.append(shared.name)
            return None

    messages = [_message(m, take) for m in request.messages]
    if missing:
        raise ServiceUnavailable(
            f"{len(missing)} of the request's images were gone before the engine read them "
            "(the request was cancelled or the server is stopping); retry",
            code="media_gone",
        )
    return dataclasses.replace(request, messages=messages)


def _put(image: Image.Image) -> SharedImage:
    """The image's pixels in a new block of this process's (``write_block``)."""
    return write_block(image)


def _take(shared: SharedImage) -> Image.Image:
    """The image of a block that is there (read when its pixels are first touched); the
    block stays, the API process unlinks it."""
    fd = shm_open(f"/{shared.name.lstrip('/')}", os.O_RDONLY, 0o600)
    os.close(fd)
    return LentImage(shared)


def _message(message: ChatMessage, convert: Any) -> ChatMessage:
    content = [_part(p, convert) for p in message.content]
    return dataclasses.replace(message, content=content)


def _part(part: Any, convert: Any) -> Any:
    if isinstance(part, ImagePart):
        return ImagePart(convert(part.image))
    if isinstance(part, VideoPart):
        return dataclasses.replace(part, frames=[convert(f) for f in part.frames])
    return part
