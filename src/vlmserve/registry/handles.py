"""A served model as the manager holds it (``ModelHandle``), and one request's use of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import ModelState

__all__ = ["Lease", "ModelHandle"]


@dataclass(slots=True, eq=False)
class ModelHandle:
    name: str
    roles: list[str]
    backend: Backend
    source: str = ""
    aliases: list[str] = field(default_factory=list)
    keep_alive: float | None = None  # seconds idle before unloading; -1 never; None: default
    last_used: float = field(default_factory=time.time)
    in_flight: int = 0
    draining: bool = False
    capabilities: frozenset[str] | None = None  # from the registry; None: not declared
    deprecated: bool = False  # resolvable by name, skipped by role selection
    loading_since: float | None = None  # wall time the current load began
    reload_pending: bool = False  # its engine failed; a reload is due (``registry.reload``)
    warming: bool = False  # loaded, answering its warm-up requests (``registry.warmup``)
    warmed: bool = False  # its latest load ended with a warm-up that answered

    @property
    def ready(self) -> bool:
        return self.backend.state is ModelState.READY and not self.warming

    @property
    def inputs(self) -> frozenset[str] | None:
        """Input kinds it takes: the registry's declaration, else what the loaded model
        reports; None while unknown."""
        if self.capabilities is not None:
            return self.capabilities
        return self.backend.capabilities()

    @property
    def identifiers(self) -> tuple[str, ...]:
        return (self.name, self.source, *self.aliases)


class Lease:
    """One request's use of a model: counted in flight (no idle unload, deactivate drains it)
    until released. ``async with`` releases at the end; streams release when they finish."""

    def __init__(self, handle: ModelHandle, activity: Any = None):
        self.handle = handle
        self._released = False
        self._activity = activity  # an ActivityClock: the idle watchdog waits for us too
        handle.in_flight += 1
        handle.last_used = time.time()
        if activity is not None:
            activity.begin()

    @property
    def backend(self) -> Backend:
        return self.handle.backend

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.handle.in_flight -= 1
            self.handle.last_used = time.time()
            if self._activity is not None:
                self._activity.end()

    async def __aenter__(self) -> Backend:
        return self.handle.backend

    async def __aexit__(self, *exc: object) -> None:
        self.release()
