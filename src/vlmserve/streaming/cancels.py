"""CancelWatch: end a stream here at once when another replica cancels it in a shared store.

Without it, the replica producing a stream sees a cancel recorded by another replica only at
its next heartbeat (2 s by default), and generates until then. A store that can announce
cancels (``RedisStore.cancels``, Redis pub/sub) is listened to for as long as the manager
runs; the heartbeat's check stays as the fallback for an announcement missed while
(re)subscribing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

from vlmserve.streaming.session import Session

__all__ = ["CancelWatch"]

logger = logging.getLogger(__name__)
RETRY_SECONDS = 1.0  # after the subscription failed (Redis restarting, network)
CANCEL_AGAIN_SECONDS = 0.05


class CancelWatch:
    def __init__(self, store: object, lookup: Callable[[str], Session | None]) -> None:
        self._cancels: Callable[[], AsyncGenerator[str, None]] | None = getattr(
            store, "cancels", None
        )
        self._lookup = lookup
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def ensure(self) -> None:
        """Start listening, unless the store cannot announce cancels or it already listens."""
        if self._cancels is None or self._closing:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._listen(self._cancels))

    async def _listen(self, cancels: Callable[[], AsyncGenerator[str, None]]) -> None:
        while not self._closing:
            try:
                async with contextlib.aclosing(cancels()) as announced:
                    async for session_id in announced:
                        session = self._lookup(session_id)
                        if session is not None:
                            session.begin_cancel()
            except Exception:
                logger.warning("listening for cancels failed; retrying", exc_info=True)
            await asyncio.sleep(RETRY_SECONDS)

    async def close(self) -> None:
        # A cancel that lands while redis-py connects is swallowed there (redis 8.1), and
        # the listener goes on to block for messages: cancel again until it has ended.
        self._closing = True
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=CANCEL_AGAIN_SECONDS)
        if self._task is not None and not self._task.cancelled():
            with contextlib.suppress(Exception):
                self._task.result()
        self._task, self._closing = None, False  # a manager may be started again
