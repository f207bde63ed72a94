"""Reload a model whose engine failed (``docs/engine.md``, "Failures").

The engine ends its own requests and marks the model failed; this module only brings the model
back: up to ``policy.reload_attempts`` unload + load cycles, attempt n after
``n * policy.reload_backoff`` seconds, the error staying in ``/health`` meanwhile. Requests that
arrive during a load wait for it, as for any activation; after the last failed attempt the
model stays failed until ``POST /admin/activate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from vlmserve.engine.types import ModelState
from vlmserve.registry.warmup import load

if TYPE_CHECKING:
    from vlmserve.registry.handles import ModelHandle
    from vlmserve.registry.manager import LifecyclePolicy

__all__ = ["Reloader"]

log = logging.getLogger(__name__)


class Reloader:
    def __init__(self, lock: Callable[[str], asyncio.Lock], policy: LifecyclePolicy):
        self._lock = lock  # the manager's per-model lock: a reload is a lifecycle change
        self.policy = policy
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        """A reload is running."""
        return bool(self._tasks)

    def watch(self, handle: ModelHandle) -> None:
        """Be told when this model's engine fails (backends without an engine never are)."""
        handle.backend.watch_failures(lambda loop: self._failed(handle, loop))

    def _failed(self, handle: ModelHandle, loop: asyncio.AbstractEventLoop | None) -> None:
        """On the engine's thread: the reload runs on ``loop`` (a failed request's), or on the
        next request's (``start`` from ``acquire``) if there is none."""
        handle.reload_pending = True
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the next request reloads
                loop.call_soon_threadsafe(self.start, handle)

    def start(self, handle: ModelHandle) -> None:
        """Start the reload of ``handle`` once, if one is due."""
        if not handle.reload_pending:
            return
        handle.reload_pending = False
        task = asyncio.get_running_loop().create_task(self._reload(handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self, handle: ModelHandle) -> None:
        attempts = self.policy.reload_attempts
        for attempt in range(1, attempts + 1):
            await asyncio.sleep(self.policy.reload_backoff * attempt)
            if handle.backend.state is not ModelState.FAILED:
                return  # reactivated or unloaded by someone else meanwhile
            log.warning(
                "model %s: %s; reloading (attempt %d of %d)",
                handle.name,
                handle.backend.error,
                attempt,
                attempts,
            )
            if await self._cycle(handle, attempt):
                log.info("model %s reloaded after its engine failed", handle.name)
                return
        log.error(
            "model %s: still failed after %d reloads; POST /admin/activate to retry",
            handle.name,
            attempts,
        )

    async def _cycle(self, handle: ModelHandle, attempt: int) -> bool:
        try:
            async with self._lock(handle.name):
                await handle.backend.aclose()
                await load(handle, self.policy.warmup)
        except Exception as exc:
            log.error(
                "model %s: reload attempt %d of %d failed: %s",
                handle.name,
                attempt,
                self.policy.reload_attempts,
                exc,
            )
            return False
        return True
