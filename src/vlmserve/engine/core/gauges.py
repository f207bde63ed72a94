"""What ``/metrics`` reads off a running engine, from any thread (plain int/float reads).

``EngineGauges`` is a part of ``BatchEngine`` (``engine.gauges``): queue and batch sizes, the
KV budget and its use, preemptions, and where step time goes (``StepTimer``: vision, prefill,
decode). It reads the engine's parts, and changes none of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from typing import Any

from vlmserve.engine.core.scheduler import Scheduler

__all__ = ["PHASES", "EngineGauges", "StepTimer"]

# vision: vision tower + prompt embeddings of admitted rows; prefill: their forward and first
# token; decode: the decode forward and sampling of every running row
PHASES = ("vision", "prefill", "decode")


class StepTimer:
    """Seconds spent per phase of the engine's steps since it started (running totals)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started


class EngineGauges:
    __slots__ = ("_inbox", "blocks", "kv", "scheduler", "timer", "vision_cache")

    def __init__(
        self,
        scheduler: Scheduler,
        kv: Any,  # kv_cache.KVBudget
        blocks: Any,  # block_manager.BlockManager
        vision_cache: Any,  # vision_cache.VisionCache
        inbox: Sized,  # requests submitted, not yet taken by the engine thread
        timer: StepTimer,
    ) -> None:
        self.scheduler, self.kv, self.blocks = scheduler, kv, blocks
        self.vision_cache, self._inbox, self.timer = vision_cache, inbox, timer

    @property
    def queued(self) -> int:
        """Requests not yet admitted to the running batch."""
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``InvalidRequest`` (400, naming the budget and the setting) when a request
        of ``prompt_tokens`` + ``max_tokens`` could never be held by the whole KV cache."""
        self.kv.check_fits(prompt_tokens, max_tokens)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV cache (whole blocks of the budget)."""
        return self.kv.nbytes

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks owned by running rows, 0..1."""
        return self.blocks.usage

    @property
    def preemptions(self) -> int:
        """Rows preempted (KV freed, recomputed later) since the engine started."""
        return self.scheduler.preemptions

    @property
    def step_seconds(self) -> dict[str, float]:
        """Running totals of step time by phase (a copy)."""
        return dict(self.timer.seconds)

    def vision_cache_stats(self) -> dict[str, int]:
        return self.vision_cache.stats()
