"""Gather concurrent requests into shared forward passes (micro-batching on the event loop).

Each request is a list of items. ``submit`` queues it and waits; one collector task per
batcher takes the queued requests when ``max_items`` items are pending or the oldest has
waited ``wait_s``, hands them to ``run`` (which does the forward passes on the model's
thread) and gives every request back exactly its own result. ``run`` returns one result or
exception per request, so one request's failure never becomes another's.

A request cancelled while it waits is removed before its batch is taken; one cancelled
while its batch runs just has its result dropped. ``wait_s=0`` still batches whatever is
queued when the collector gets to run (everything submitted in the same loop iteration).

``shared_passes`` is the blocking side that the embedding and reranker backends hand their
batch function to: every request's items in one call, split back by request; when that
fails, each request again alone, so only the request at fault gets the error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vlmserve.errors import ConfigError

__all__ = ["MicroBatcher", "RunGroups", "shared_passes"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
# [request][item] -> one result (or the exception to raise) per request, in order
RunGroups = Callable[[list[list[T]]], Awaitable[list[R | BaseException]]]


@dataclass(slots=True, eq=False)  # eq=False: compared by identity when removed
class _Waiting(Generic[T, R]):
    items: list[T]
    future: asyncio.Future[R]
    arrived: float = field(default=0.0)


class MicroBatcher(Generic[T, R]):
    """Queue of requests on one event loop, drained by one collector task at a time."""

    def __init__(self, run: RunGroups[T, R], *, max_items: int, wait_s: float):
        self.run = run
        self.max_items = max_items  # items per forward pass (``run`` splits bigger batches)
        self.wait_s = wait_s  # longest the oldest waiting request waits for company
        self.batches = 0  # batches handed to ``run``
        self._pending: list[_Waiting[T, R]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collector: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None

    @classmethod
    def for_model(
        cls, run: RunGroups[T, R], model_id: str, max_batch: int, wait_ms: float
    ) -> MicroBatcher[T, R]:
        """A model's batcher: ``max_batch`` items per forward pass (a ``ConfigError`` naming
        the model below 1), each request waiting up to ``wait_ms`` for company."""
        if max_batch < 1:
            raise ConfigError(f"max_batch is {max_batch} for {model_id!r}; it must be at least 1")
        return cls(run, max_items=max_batch, wait_s=wait_ms / 1000)

    @property
    def pending_items(self) -> int:
        return sum(len(w.items) for w in self._pending)

    async def submit(self, items: list[T]) -> R:
        """Queue ``items`` as one request; its result once a batch holding it has run."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new loop (tests): start afresh
            self._loop, self._pending, self._collector, self._wakeup = loop, [], None, None
        waiting: _Waiting[T, R] = _Waiting(items, loop.create_future(), loop.time())
        self._pending.append(waiting)
        self._wake()
        if self._collector is None or self._collector.done():
            self._collector = loop.create_task(self._collect(), name="embed-batcher")
        try:
            return await waiting.future
        except asyncio.CancelledError:
            if waiting in self._pending:  # not taken yet: no forward pass includes it
                self._pending.remove(waiting)
            raise

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _collect(self) -> None:
        while self._pending:
            await self._gather()
            taken = self._take()
            if taken:
                await self._run(taken)

    async def _gather(self) -> None:
        """Wait until ``max_items`` items are queued or the oldest request's wait is over."""
        loop = asyncio.get_running_loop()
        while self._pending and self.pending_items < self.max_items:
            remaining = self._pending[0].arrived + self.wait_s - loop.time()
            if remaining <= 0:
                return
            self._wakeup = loop.create_future()
            await asyncio.wait([self._wakeup], timeout=remaining)

    def _take(self) -> list[_Waiting[T, R]]:
        """Oldest first, every request that starts within the first ``max_items`` items.

        The last one may reach past ``max_items``: ``run`` splits the items into passes of
        ``max_items``, so a request bigger than the rest of a pass fills the next one.
        """
        taken: list[_Waiting[T, R]] = []
        count = 0
        while self._pending and count < self.max_items:
            waiting = self._pending.pop(0)
            if not waiting.future.done():  # cancelled ones are skipped
                taken.append(waiting)
                count += len(waiting.items)
        return taken

    async def _run(self, taken: list[_Waiting[T, R]]) -> None:
        self.batches += 1
        try:
            results = await self.run([w.items for w in taken])
        except asyncio.CancelledError:  # the collector is cancelled: so are its requests
            for waiting in taken:
                waiting.future.cancel()
            raise
        except Exception as exc:  # ``run`` itself failed: every request in the batch fails
            log.exception("embedding batch of %d requests failed", len(taken))
            for waiting in taken:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
            return
        for waiting, result in zip(taken, results, strict=True):
            if waiting.future.done():  # cancelled while its batch ran
                continue
            if isinstance(result, BaseException):
                waiting.future.set_exception(result)
            else:
                waiting.future.set_result(result)


def shared_passes(
    run: Callable[[list[T]], R],
    groups: list[list[T]],
    split: Callable[[R, list[int]], list[R]],
    what: str,
) -> list[R | BaseException]:
    """Blocking, on the model's thread: ``run`` over every request's items at once, its
    result cut back into one per request by ``split(result, offsets)`` (request ``i`` holds
    items ``offsets[i]:offsets[i + 1]``); if that fails, each request alone, so that only
    the failing request gets an exception. ``what`` names the requests in the log."""
    try:
        together = run([item for group in groups for item in group])
    except Exception as exc:
        if len(groups) == 1:
            return [exc]
        log.info(
            "a batch of %d %s requests failed (%s); running each alone", len(groups), what, exc
        )
        return [_alone(run, group) for group in groups]
    return [*split(together, list(itertools.accumulate(map(len, groups), initial=0)))]


def _alone(run: Callable[[list[T]], R], items: list[T]) -> R | BaseException:
    try:
        return run(items)
    except Exception as exc:
        return exc
