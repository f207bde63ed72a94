"""Group commit: appends that arrive while a write is under way go out together in the next one.

Each caller still waits until *its* item is durable (the store's promise: ``append`` returns
after the commit), so nothing is sent to a client before it is stored. What changes is the
cost: under load (many sessions streaming, each engine step producing one event per session)
one transaction carries all the events that queued during the previous one, instead of one
transaction — and one thread hop — per event. An idle store writes at once: there is no timer
and no added latency.

The queue is per event loop (a store may be shared by the loops of several test apps); a
write's results are per item, so one bad item fails only its own caller.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["GroupCommit"]

T = TypeVar("T")
# write(items) -> one entry per item: None (stored) or the exception that item failed with
Write = Callable[[list[T]], Awaitable[Sequence[BaseException | None]]]


@dataclass(slots=True)
class _Queue(Generic[T]):
    pending: list[tuple[T, asyncio.Future[None]]] = field(default_factory=list)
    draining: asyncio.Task[None] | None = None


class GroupCommit(Generic[T]):
    def __init__(self, write: Write[T]):
        self._write = write
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue[T]] = (
            weakref.WeakKeyDictionary()
        )
        self.writes = 0  # transactions run (for tests and benchmarks)
        self.items = 0  # items written

    async def submit(self, item: T) -> None:
        """Queue ``item`` and wait until the write that carries it is done."""
        await self.put(item)

    def put(self, item: T) -> asyncio.Future[None]:
        """Queue ``item``; the future is done when the write that carries it is (no task and
        no coroutine per item: a session's events are handed over this way)."""
        loop = asyncio.get_running_loop()
        queue = self._queues.setdefault(loop, _Queue())
        done: asyncio.Future[None] = loop.create_future()
        queue.pending.append((item, done))
        if queue.draining is None:
            queue.draining = loop.create_task(self._drain(queue))
        return done

    async def _drain(self, queue: _Queue[T]) -> None:
        try:
            while queue.pending:
                batch, queue.pending = queue.pending, []
                await self._write_batch(batch)
        finally:
            queue.draining = None

    async def _write_batch(self, batch: list[tuple[T, asyncio.Future[None]]]) -> None:
        try:
            errors: Sequence[BaseException | None] = await self._write([i for i, _ in batch])
        except BaseException as exc:  # the whole write failed (closed store, cancelled loop)
            errors = [exc] * len(batch)
        self.writes += 1
        self.items += len(batch)
        for (_, done), error in zip(batch, errors, strict=True):
            if done.done():
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
