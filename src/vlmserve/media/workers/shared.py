"""Decoded pixels handed from a media worker to the API process through shared memory, and
on to the engine process in the same block.

A worker's result is walked once: every PIL image in it (alone, in a list or tuple, or in a
dataclass such as ``VideoFrames``) is written into its own POSIX shared memory block
(``write_block``) and replaced by a ``SharedImage`` naming it. Only those small descriptors
cross the pipe. The API process does not copy the pixels out: each descriptor becomes a
``BlockImage``, a PIL image whose pixels stay in the worker's block until something in the
API process reads them. A chat request for an engine in its own process lends the block to
the engine (``engine/proc/pixels.py``), which reads it once; consumers in the API process
(embeddings, rerank, an engine in this process) read it when they touch the pixels, as PIL
does with a file.

``write_bytes`` and ``take_block`` carry any other buffer one way, from the process that
writes it to the one that maps it (the engine's preprocessing workers' patch rows).

The API process owns every image block: the engine only reads. A block is unlinked exactly
once, when its ``BlockImage`` is garbage (a finished, cancelled or refused request; an entry
dropped from the media-by-reference cache) or as soon as the API process has read its pixels
and no engine is reading it; the resource tracker unlinks what a killed server leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import secrets
import threading
import weakref
from _posixshmem import (  # type: ignore[import-not-found]  # SharedMemory's calls, untracked
    shm_open,
    shm_unlink,
)
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
from blake3 import blake3
from PIL import Image
from PIL._util import DeferredError

from vlmserve.errors import ServiceUnavailable

__all__ = [
    "BlockImage",
    "LentImage",
    "SharedImage",
    "held",
    "map_rgb",
    "pixel_digest",
    "read_block",
    "release",
    "release_block",
    "take_block",
    "to_shared",
    "write_block",
    "write_bytes",
]


PREFIX = "/vlmserve_px_"  # the blocks' names in /dev/shm


@dataclass(slots=True, frozen=True)
class SharedImage:
    name: str  # the shared memory block
    mode: str
    size: tuple[int, int]
    nbytes: int
    digest: bytes = b""  # ``pixel_digest`` of the pixels, made where they were written

    @classmethod
    def put(cls, image: Image.Image) -> SharedImage:
        return write_block(image)


def write_block(image: Image.Image) -> SharedImage:
    """The image's pixels in a new block (``write_bytes``), hashed (``pixel_digest``)."""
    data = image.tobytes()
    name = write_bytes(data)
    return SharedImage(name, image.mode, image.size, len(data), pixel_digest(data))


def write_bytes(data: bytes | memoryview) -> str:
    """``data`` in a new block, written with ``pwrite``: the copy runs without the GIL and
    without a page fault per page (a copy into a mapping took about twice as long for a
    1280x960 photo), and a full ``/dev/shm`` is an error, not a SIGBUS. The block is
    registered with the resource tracker (the API process's; every worker process shares
    it), which unlinks it should the server die before it is released. -> its name."""
    path = f"{PREFIX}{secrets.token_hex(8)}"
    fd = shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    view = memoryview(data).cast("B")
    try:
        resource_tracker.register(path, "shared_memory")
        os.ftruncate(fd, max(1, len(view)))
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
    except BaseException as exc:
        release_block(path)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise _shm_full(len(view)) from exc
        raise
    finally:
        view.release()
        os.close(fd)
    return path.lstrip("/")


def take_block(name: str, nbytes: int) -> mmap.mmap:
    """A block another process wrote for this one, mapped here and unlinked at once: its
    pages live as long as the mapping (an array made on it with ``numpy.frombuffer`` keeps
    it), no copy is made, and nothing is left in ``/dev/shm``."""
    path = f"/{name.lstrip('/')}"
    fd = shm_open(path, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, max(1, nbytes))
    finally:
        os.close(fd)
        release_block(name)


def pixel_digest(data: bytes | memoryview) -> bytes:
    """A 128-bit BLAKE3 hash of an image's raw pixels (``tobytes``). Made once, by the process
    that writes the block (a media worker, or a media thread), so that a reader can key the
    image by content without reading it. BLAKE3 hashes a 1280x960 photo's 3.7 MB in about 1
    ms on one core without the GIL (BLAKE2b: 5-6 ms); a cryptographic hash, because the key
    decides whose cached pixels a request is answered with."""
    return blake3(data).digest(16)


def _shm_full(nbytes: int) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"shared memory (/dev/shm) has no room for {nbytes} bytes of decoded pixels; retry, "
        "and give the server a larger /dev/shm (docker run --shm-size) or less media memory "
        "(VLMSERVE_MEDIA_MEMORY)",
        retry_after=1.0,
        code="shared_memory_full",
    )


def read_block(shared: SharedImage) -> bytes:
    """The block's pixels (``pread``: the copy runs without the GIL and without a page fault
    per page). Opened without this process's resource tracker; nothing is unlinked."""
    fd = shm_open(f"/{shared.name.lstrip('/')}", os.O_RDONLY, 0o600)
    try:
        pieces: list[bytes] = []
        done = 0
        while done < shared.nbytes:
            pieces.append(os.pread(fd, shared.nbytes - done, done))
            if not pieces[-1]:
                raise FileNotFoundError(f"shared memory block {shared.name} is short")
            done += len(pieces[-1])
    finally:
        os.close(fd)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def map_rgb(shared: SharedImage) -> np.ndarray:
    """An RGB block's pixels as a [height, width, 3] uint8 array on a private mapping of the
    block: nothing is read or copied until used (the pages are the block's own until
    written), and the block is left as it is (a lender's block is not unlinked; the mapping
    outlives an unlink). FileNotFoundError when it is gone."""
    width, height = shared.size
    if shared.mode != "RGB" or shared.nbytes != width * height * 3:
        raise ValueError(f"not an RGB block: {shared.mode} {shared.size}, {shared.nbytes} bytes")
    fd = shm_open(f"/{shared.name.lstrip('/')}", os.O_RDONLY, 0o600)
    try:
        mapped = mmap.mmap(fd, shared.nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8).reshape(height, width, 3)


def release_block(name: str) -> None:
    """Unlink a block this process answers for and drop it from the resource tracker (the
    media workers share the API process's)."""
    path = f"/{name.lstrip('/')}"
    with contextlib.suppress(FileNotFoundError):
        shm_unlink(path)
    with contextlib.suppress(Exception):  # the tracker is gone while the server exits
        resource_tracker.unregister(path, "shared_memory")


class _InBlock(Image.Image):
    """A PIL image whose pixels are in a shared block until something reads them: size, mode
    and bands need no read; any pixel access (``load``, ``tobytes``, ``convert``,
    ``numpy.asarray``, ...) reads the block once (``_read``)."""

    def __init__(self, shared: SharedImage):
        super().__init__()
        self._mode, self._size = shared.mode, shared.size
        self.shared = shared
        self._lock = threading.RLock()

    @property
    def im(self) -> Any:
        if self._im is None:
            self.load()
        if isinstance(self._im, DeferredError):  # closed
            raise self._im.ex
        return self._im

    @im.setter
    def im(self, value: Any) -> None:
        self._im = value

    def load(self) -> Any:
        with self._lock:
            if self._im is None:
                self._im = Image.frombytes(self.mode, self.size, self._read()).im
        return super().load()

    def _read(self) -> bytes:
        raise NotImplementedError

    def __reduce__(self) -> Any:  # pickled, it is a plain image
        return _plain, (self.mode, self.size, self.tobytes())


class BlockImage(_InBlock):
    """A media worker's block, owned by the API process until something reads it.

    ``lend`` names the block to a reader in another process while it is still there;
    ``give_back`` ends that loan.
    """

    def __init__(self, shared: SharedImage):
        super().__init__(shared)
        self._lent = 0
        self._release = weakref.finalize(self, release_block, shared.name)

    def _read(self) -> bytes:
        if not self._release.alive:
            raise FileNotFoundError(f"shared memory block {self.shared.name} is gone")
        pixels = read_block(self.shared)
        if not self._lent:  # read here; nobody else needs the block
            self._release()
        return pixels

    def lend(self) -> SharedImage | None:
        """The block's name for a reader in another process, or None when it is gone (the
        pixels were read here: copy them)."""
        with self._lock:
            if not self._release.alive:
                return None
            self._lent += 1
            return self.shared

    def give_back(self) -> None:
        """One ``lend`` is over: the other process has read the block, or never will."""
        with self._lock:
            self._lent -= 1
            if not self._lent and self._im is not None:
                self._release()

    @property
    def held(self) -> bool:
        """The block is still there."""
        return self._release.alive


class LentImage(_InBlock):
    """Another process's block, read on first access (the engine process's view of a
    request's image). It never unlinks the block: the lender answers for it, and keeps it
    until the engine has prepared the request. A reader that only needs the image's content
    key (``pixel_digest``) or its block's name never reads the pixels."""

    @property
    def pixel_digest(self) -> bytes:
        return self.shared.digest

    def _read(self) -> bytes:
        try:
            return read_block(self.shared)
        except FileNotFoundError as exc:
            raise _gone() from exc

    def rgb(self) -> np.ndarray:
        """``map_rgb`` of the block (RGB blocks only): the pixels without reading them."""
        try:
            return map_rgb(self.shared)
        except FileNotFoundError as exc:
            raise _gone() from exc


def _gone() -> ServiceUnavailable:  # unlinked: cancelled, or the server stops
    return ServiceUnavailable(
        "the request's image was gone before the engine read it (the request was cancelled "
        "or the server is stopping); retry",
        code="media_gone",
    )


def _plain(mode: str, size: tuple[int, int], data: bytes) -> Image.Image:
    return Image.frombytes(mode, size, data)


def to_shared(value: Any) -> Any:
    """``value`` with each PIL image replaced by a ``SharedImage`` (runs in the worker); when
    one cannot be written, the blocks already written for it are unlinked."""
    made: list[str] = []

    def put(image: Image.Image) -> SharedImage:
        shared = write_block(image)
        made.append(shared.name)
        return shared

    try:
        return _walk(value, put, Image.Image)
    except BaseException:
        for name in made:
            release_block(name)
        raise


def held(value: Any) -> Any:
    """``to_shared`` undone without a copy: each ``SharedImage`` a ``BlockImage``, which owns
    its block from now on (runs in the API process)."""
    return _walk(value, BlockImage, SharedImage)


def release(value: Any) -> None:
    """Unlink every block a worker's result names (a result nobody will use)."""
    _walk(value, lambda shared: release_block(shared.name), SharedImage)


def _walk(value: Any, convert: Any, kind: type) -> Any:
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, list):
        return [_walk(v, convert, kind) for v in value]
    if isinstance(value, tuple):
        return tuple(_walk(v, convert, kind) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, convert, kind) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _walk(getattr(value, f.name), convert, kind) for f in _fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def _fields(value: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(value) if f.init]
