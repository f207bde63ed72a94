"""A byte budget for media in flight (``--media-memory``), admitted before a body is read.

A request's media cost memory long before the engine sees them: the body as received, its
parsed JSON text, the copy sent to a media worker, the base64-decoded bytes, the decoded
pixels. ``MediaBudget`` counts them from the moment they are read: the decoded media until
they are handed to the engine (``hand_over``), the body (held by the request's parsed form)
until the request ends. A request is admitted by its ``Content-Length`` (times
``BODY_FACTOR``) before a byte of it is read; one that does not fit waits in a bounded FIFO
queue, and is refused with a 429 and ``Retry-After`` when the queue is full or its wait runs
out. One body larger than the whole budget is a 413 naming the setting.

Decoded media are charged with ``Lease.grow`` as they appear; growing never waits (the
request is already admitted and waiting there could deadlock two admitted requests), it
makes the next admissions wait instead.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from dataclasses import dataclass, field

from vlmserve.errors import Overloaded, PayloadTooLarge

__all__ = ["BODY_FACTOR", "PIXEL_FACTOR", "Lease", "MediaBudget", "current_lease", "hand_over"]

# a body is held about four times while its media are read: the bytes as received, the parsed
# JSON text, and the copy pickled to a media worker with its unpickled text there (or, with no
# workers, the base64 text's cleaned copy and the bytes being decoded)
BODY_FACTOR = 4
# decoded pixels: the decoder's image, its shared memory block (a media worker's, or one this
# process writes for the engine process) and the engine's image
PIXEL_FACTOR = 3
SETTING = "VLMSERVE_MEDIA_MEMORY"


@dataclass(slots=True)
class Lease:
    """One request's share of the budget; ``release`` is idempotent."""

    budget: MediaBudget
    nbytes: int  # the body's share, held until the request ends
    decoded: int = 0  # decoded media, held until they are handed to the engine
    released: bool = False

    def grow(self, nbytes: int) -> None:
        """Charge media decoded for this request (never waits)."""
        if self.released or nbytes <= 0:
            return
        self.decoded += nbytes
        self.budget.used += nbytes

    def hand_over(self) -> None:
        """The decoded media are the engine's now."""
        self.budget.used -= self.decoded
        self.decoded = 0
        self.budget.wake()

    def release(self) -> None:
        if self.released:
            return
        self.hand_over()
        self.released = True
        self.budget.used -= self.nbytes
        self.budget.wake()


_LEASE: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("media_lease", default=None)


def current_lease() -> Lease | None:
    """The lease of the request being served in this context (set by the admission layer)."""
    return _LEASE.get()


def hand_over() -> None:
    """The request's decoded media now belong to the engine: they leave the budget."""
    lease = _LEASE.get()
    if lease is not None:
        lease.hand_over()


@dataclass(slots=True)
class MediaBudget:
    """Bytes of media in flight, at most ``total``; FIFO admission with a bounded queue."""

    total: int
    queue_max: int = 32  # requests waiting for room; one more is a 429
    max_wait: float = 30.0  # seconds a request waits for room before its 429
    used: int = 0
    _waiters: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def use(self, lease: Lease) -> contextvars.Token[Lease | None]:
        """Make ``lease`` the current request's (``current_lease``)."""
        return _LEASE.set(lease)

    async def admit(self, nbytes: int) -> Lease:
        """A lease of ``nbytes``, once they fit; 413 when they never can, 429 when the queue
        is full or the wait runs out."""
        if nbytes > self.total:
            raise PayloadTooLarge(
                f"the request needs {nbytes} bytes of media memory; the whole budget is "
                f"{self.total} bytes ({SETTING}); send smaller media or URLs",
                code="media_memory_exceeded",
            )
        if not self._waiters and self.used + nbytes <= self.total:
            self.used += nbytes
            return Lease(self, nbytes)
        if len(self._waiters) >= self.queue_max:
            raise self._busy()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_wait)
        except asyncio.TimeoutError:
            self._forget(entry)
            raise self._busy() from None
        except BaseException:
            self._forget(entry)
            raise
        return Lease(self, nbytes)

    def _forget(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A waiter that gives up: out of the queue, or its granted bytes handed back."""
        nbytes, future = entry
        if future.done() and not future.cancelled():
            self.used -= nbytes
        else:
            future.cancel()
            if entry in self._waiters:
                self._waiters.remove(entry)
        self.wake()

    def wake(self) -> None:
        """Grant waiting requests, in order, while they fit."""
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if self.used + nbytes > self.total:
                return
            self._waiters.popleft()
            self.used += nbytes
            future.set_result(None)

    def _busy(self) -> Overloaded:
        return Overloaded(
            f"media memory is in use by other requests ({self.used} of {self.total} bytes, "
            f"{len(self._waiters)} waiting; {SETTING}); retry after Retry-After seconds",
            retry_after=1.0,
            code="media_memory_busy",
        )
