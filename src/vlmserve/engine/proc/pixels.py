"""A request's images handed to the engine process through shared memory, not pickled.

A 1280x960 photo is 3.7 MB of pixels; pickled into the ``prepare`` message it would be
copied into the pickle, through the pipe, into the engine's receive buffer and out of it again.
Instead ``ship`` (API process) writes each image and video frame of a ``GenerateRequest``
into its own POSIX shared memory block and sends a copy of the request whose
parts name the blocks (``SharedImage``); ``receive`` (engine process) reads each block, copies
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
import os
import secrets
from _posixshmem import shm_open, shm_unlink  # the block calls SharedMemory makes, untracked
from concurrent.futures import Executor
from multiprocessing import resource_tracker
from typing import Any

from PIL import Image

from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, VideoPart
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.shared import SharedImage

__all__ = ["has_media", "receive", "release", "ship", "shipped"]

_PREFIX = "/vlmserve_px_"  # the blocks' names in /dev/shm


def has_media(request: GenerateRequest) -> bool:
    return any(isinstance(p, ImagePart | VideoPart) for m in request.messages for p in m.content)


def ship(request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
    """A copy of ``request`` with its pixels in shared blocks, and the blocks' names."""
    names: list[str] = []

    def put(image: Any) -> SharedImage:
        shared = _put(image)
        names.append(shared.name)
        return shared

    try:
        messages = [_message(m, put) for m in request.messages]
    except BaseException:
        release(names)
        raise
    return dataclasses.replace(request, messages=messages), names


async def shipped(
    request: GenerateRequest, executor: Executor | None = None
) -> tuple[GenerateRequest, list[str]]:
    """``ship`` on a thread of ``executor`` (default asyncio's; a photo's copy would hold the
    event loop); a caller cancelled meanwhile leaves no blocks behind."""
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(loop.run_in_executor(executor, ship, request))
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


def _put(image: Image.Image) -> SharedImage:
    """The image's pixels in a new block, written with ``pwrite``: the copy runs without the
    GIL and without a page fault per page (a copy into a mapping took about twice as long
    for a 1280x960 photo, the GIL held throughout). The block is registered with this
    process's resource tracker, which unlinks it should this process die before ``release``."""
    data = image.tobytes()
    path = f"{_PREFIX}{secrets.token_hex(8)}"
    fd = shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        resource_tracker.register(path, "shared_memory")
        os.ftruncate(fd, max(1, len(data)))
        with memoryview(data) as view:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], done)
    except BaseException:
        release([path])
        raise
    finally:
        os.close(fd)
    return SharedImage(path.lstrip("/"), image.mode, image.size, len(data))


def _take(shared: SharedImage) -> Image.Image:
    """The image read out of its block (``pread``, without the GIL), which is unlinked. The
    block is opened without this process's resource tracker: the API process that made it
    answers for it."""
    path = f"/{shared.name.lstrip('/')}"
    fd = shm_open(path, os.O_RDONLY, 0o600)
    try:
        pieces: list[bytes] = []
        done = 0
        while done < shared.nbytes:
            pieces.append(os.pread(fd, shared.nbytes - done, done))
            if not pieces[-1]:
                raise FileNotFoundError(f"shared memory block {path} is shorter than its image")
            done += len(pieces[-1])
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            shm_unlink(path)
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return Image.frombytes(shared.mode, shared.size, data)


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
