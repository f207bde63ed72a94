"""The media pipeline one server runs: its byte budget and its worker pool, from the settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmserve.media.workers.budget import MediaBudget
from vlmserve.media.workers.pool import MediaPool, default_workers

if TYPE_CHECKING:
    from vlmserve.config import Settings

__all__ = ["MediaPipeline"]

log = logging.getLogger("vlmserve.media")


@dataclass(slots=True)
class MediaPipeline:
    budget: MediaBudget
    pool: MediaPool | None  # None: media are decoded on a thread of the API process

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaPipeline:
        workers = settings.media_workers
        workers = default_workers() if workers is None else workers
        budget = MediaBudget(
            settings.media_memory, queue_max=settings.media_queue, max_wait=settings.media_timeout
        )
        pool = MediaPool(workers, nice=settings.media_worker_nice) if workers > 0 else None
        return cls(budget, pool)

    async def start(self) -> None:
        """Start the workers now, so the first image does not pay for their start."""
        if self.pool is None:
            return
        try:
            pids = await self.pool.start()
        except Exception:  # the first request starts them again and reports the cause
            log.exception("media workers failed to start")
            return
        log.info("media workers started: %s", ", ".join(map(str, pids)))

    def waiting(self) -> int:
        return self.budget.waiting

    def decodes(self) -> int:
        return 0 if self.pool is None else self.pool.in_flight

    def held(self) -> int:
        return self.budget.used

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
