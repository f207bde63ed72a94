"""``RowGate``: a durable session's events wait for the session's own row, in order.

A new stream's producer (the engine's work) starts while the store commits the session's row
(``SessionManager.start``); waiting for that commit first delayed every stream's start. The
events issued meanwhile are held here and handed to the store, in order, once the row is in.
If the row's commit fails, they fail with it and nothing more goes to the store.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from vlmserve.streaming.events import Event, SessionState

__all__ = ["RowGate"]

Publish = Callable[[Event, SessionState | None], "asyncio.Future[None]"]


class RowGate:
    def __init__(self, created: asyncio.Future[None], publish: Publish) -> None:
        self._publish = publish  # starts an event's commit (after the row's)
        self._held: list[tuple[Event, SessionState | None, asyncio.Future[None]]] = []
        self._open = False
        self._failure: BaseException | None = None
        created.add_done_callback(self._row_done)

    @property
    def open(self) -> bool:
        """The row is in: events go to the store as they come."""
        return self._open

    def submit(self, event: Event, final: SessionState | None) -> asyncio.Future[None]:
        """The event's commit: started now once the row is in, else held back."""
        if self._open:
            return self._publish(event, final)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:  # the row's commit failed: nothing goes to the store
            waiter.set_exception(self._failure)
        else:
            self._held.append((event, final, waiter))
        return waiter

    def _row_done(self, created: asyncio.Future[None]) -> None:
        """The held events start their commits in the order they were issued: each task's
        first step hands its event to the store, and tasks start in the order they are made."""
        held, self._held = self._held, []
        self._failure = failure(created)
        self._open = self._failure is None
        for event, final, waiter in held:
            if self._failure is not None:
                if not waiter.done():
                    waiter.set_exception(self._failure)
                continue
            self._publish(event, final).add_done_callback(functools.partial(_settle, waiter))


def failure(future: asyncio.Future[None]) -> BaseException | None:
    """Why a done future failed (None: it succeeded)."""
    return asyncio.CancelledError() if future.cancelled() else future.exception()


def _settle(waiter: asyncio.Future[None], done: asyncio.Future[None]) -> None:
    if waiter.done():
        return
    why = failure(done)
    if why is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(why)
