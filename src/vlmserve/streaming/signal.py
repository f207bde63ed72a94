"""``Signal``: wake every coroutine waiting for a condition, from plain (non-async) code.

A session wakes its listeners once per published event, from the callback that sees the
event's commit done; an ``asyncio.Condition`` would need its lock, so a coroutine per event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Signal"]


class Signal:
    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def wake(self) -> None:
        """Every waiter checks its condition again."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def until(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` holds (checked now and at each ``wake``)."""
        while not ready():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
