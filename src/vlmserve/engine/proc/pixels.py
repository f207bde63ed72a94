"""A request's images handed to the engine process through shared memory, not pickled.

A 1280x960 photo is 3.7 MB of pixels; pickled into the ``prepare`` message it would be
copied into the pickle, through the pipe, into the engine's receive buffer and out of it again.
Instead ``ship`` (API process) writes each image and video frame of a ``GenerateRequest``
into its own ``multiprocessing.shared_memory`` block and sends a copy of the request whose
parts name the blocks (``SharedImage``); ``receive`` (engine process) maps each block, copies
the pixels into an image and unlinks it, every block of the request even when one fails.

The API process stays answerable for the blocks until the engine has answered the
``prepare``: ``release`` then unlinks any block still there (the engine died, the request was
cancelled before the engine took it) and drops them from this process's resource tracker, so
neither a failed request nor a crashed engine leaves pixels in ``/dev/shm``. Requests without
media go over as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
from _posixshmem import shm_open, shm_unlink  # the block calls SharedMemory makes, untracked
from multiprocessing import resource_tracker
from typing import Any

from PIL import Image

from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, VideoPart
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.shared import SharedImage

__all__ = ["has_media", "receive", "release", "ship", "shipped"]


def has_media(request: GenerateRequest) -> bool:
    return any(isinstance(p, ImagePart | VideoPart) for m in request.messages for p in m.content)


def ship(request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
    """A copy of ``request`` with its pixels in shared blocks, and the blocks' names."""
    names: list[str] = []

    def put(image: Any) -> SharedImage:
        shared = SharedImage.put(image)
        names.append(shared.name)
        return shared

    try:
        messages = [_message(m, put) for m in request.messages]
    except BaseException:
        release(names)
        raise
    return dataclasses.replace(request, messages=messages), names


async def shipped(request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
    """``ship`` on a thread (a photo's copy would hold the event loop); a caller cancelled
    meanwhile leaves no blocks behind."""
    work = asyncio.ensure_future(asyncio.to_thread(ship, request))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(_release_shipped)
        raise


def _release_shipped(work: asyncio.Future[tuple[GenerateRequest, list[str]]]) -> None:
    if not work.cancelled() and work.exception() is None:
        release(work.result()[1])


def receive(request: GenerateRequest) -> GenerateRequest:
    """``request`` with its images out of their blocks (runs in the engine process)."""
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


def _take(shared: SharedImage) -> Image.Image:
    """The image copied out of its block, which is unlinked. The block is opened without
    this process's resource tracker: the API process that made it answers for it."""
    path = f"/{shared.name.lstrip('/')}"
    fd = shm_open(path, os.O_RDONLY, 0o600)
    try:
        block = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        with block, memoryview(block) as view, view[: shared.nbytes] as pixels:
            return Image.frombytes(shared.mode, shared.size, pixels)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            shm_unlink(path)


def release(names: list[str]) -> None:
    """The API process's share of the blocks ends: unlink what the engine did not take."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            _unlink(name)
        with contextlib.suppress(Exception):  # the tracker is gone while the server exits
            resource_tracker.unregister(f"/{name.lstrip('/')}", "shared_memory")


def _unlink(name: str) -> None:
    shm_unlink(f"/{name.lstrip('/')}")


def _message(message: ChatMessage, convert: Any) -> ChatMessage:
    content = [_part(p, convert) for p in message.content]
    return dataclasses.replace(message, content=content)


def _part(part: Any, convert: Any) -> Any:
    if isinstance(part, ImagePart):
        return ImagePart(convert(part.image))
    if isinstance(part, VideoPart):
        return dataclasses.replace(part, frames=[convert(f) for f in part.frames])
    return part
