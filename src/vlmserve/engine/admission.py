"""Queue admission of a chat model, shared by the in-process backend and the engine
process's client: a request holds a queue place from ``admit`` (before any work) until it
reaches the engine, so requests that prepare concurrently cannot overfill the queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlmserve.errors import Overloaded

__all__ = ["QueuePlaces"]


@dataclass(slots=True)
class QueuePlaces:
    """The places held by admitted requests that have not reached the engine yet."""

    model_id: str
    reserved: int = 0

    def refuse_if_full(self, waiting: int, limit: int | None) -> None:
        """``Overloaded`` (a 429) when ``waiting`` requests fill the queue (``limit``
        places; None: no limit)."""
        if limit is not None and waiting >= limit:
            raise Overloaded(
                f"{waiting} requests are already waiting for {self.model_id!r} "
                "(VLMSERVE_MAX_QUEUED_REQUESTS); retry later"
            )

    def admit(self, waiting: int, limit: int | None) -> Callable[[], None]:
        """Hold a place, counting those already held on top of ``waiting``; returns its
        release (idempotent: call it when the request reaches the engine, or fails)."""
        self.refuse_if_full(waiting + self.reserved, limit)
        self.reserved += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.reserved -= 1

        return release
