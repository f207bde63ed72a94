"""A pool of upstream replicas of one model: least outstanding requests, health, ejection.

Why these rules (Envoy's outlier detection, trimmed to what a gateway of a few workers needs):

- **choice**: the healthy, non-ejected replica with the fewest requests in flight (ties go to
  the one used longest ago), so a slow replica gets less work without any tuning; a request
  that must reach one replica (media sent there by ``uuid``, ``media_routes.py``) names it as
  ``prefer`` and gets it while it is usable and has room.
- **passive ejection**: ``max_failures`` consecutive failures (connection refused or reset,
  5xx) take a replica out for ``eject_seconds``; it comes back by itself afterwards.
- **active checks**: ``check`` marks a replica healthy or not with the reason; a replica that
  failed preflight stays out until it is registered or activated again.
- **admission**: at most ``max_queued`` requests of this model are admitted at once (in flight
  or waiting for a replica slot); more get 429. With ``max_concurrency`` per replica, admitted
  requests wait for a free slot. No usable replica at all: 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmserve.errors import Overloaded, ServiceUnavailable

__all__ = ["PoolPolicy", "Replica", "ReplicaPool"]


@dataclass(slots=True)
class PoolPolicy:
    max_failures: int = 3  # consecutive failures that eject a replica
    eject_seconds: float = 30.0  # cool-down before an ejected replica gets traffic again
    max_queued: int = 256  # requests admitted at once (in flight + waiting); more: 429
    max_concurrency: int = 0  # requests in flight per replica; 0 = no cap
    retry_after: float = 5.0  # Retry-After when no replica is usable and none comes back sooner


@dataclass(slots=True, eq=False)
class Replica:
    url: str  # base URL, without a trailing slash and without /v1
    instance: str | None = None  # the registering worker's id (deregistration uses it)
    outstanding: int = 0
    failures: int = 0  # consecutive
    healthy: bool = True  # the last active check (or preflight) passed
    reason: str | None = None  # why it is unhealthy or ejected
    preflight_failed: bool = False  # out until registered or activated again
    ejected_until: float = 0.0  # monotonic time
    requests: int = 0  # total routed here
    last_used: float = 0.0
    sessions: bool = False  # its /health says it runs vlmserve's resumable streams

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def usable(self, now: float) -> bool:
        return self.healthy and not self.preflight_failed and not self.ejected(now)

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "url": self.url,
            "instance": self.instance,
            "healthy": self.healthy and not self.preflight_failed,
            "ejected_for_seconds": max(0.0, self.ejected_until - now) or None,
            "outstanding": self.outstanding,
            "consecutive_failures": self.failures,
            "requests": self.requests,
            "reason": self.reason,
        }


def _clean(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


class ReplicaPool:
    """The replicas of one upstream model (see the module docstring for the rules)."""

    def __init__(
        self,
        model: str,
        urls: list[str] | None = None,
        policy: PoolPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model = model
        self.policy = policy or PoolPolicy()
        self._clock = clock
        self.replicas: list[Replica] = [Replica(_clean(u)) for u in urls or []]
        self.admitted = 0
        self._freed: asyncio.Event | None = None

    # --- membership ------------------------------------------------------------------------
    def add(self, url: str, instance: str | None = None) -> Replica:
        """Add a replica (or refresh the one with this URL/instance: it gets a clean slate)."""
        url = _clean(url)
        for r in self.replicas:
            if r.url == url or (instance is not None and r.instance == instance):
                r.url, r.instance = url, instance or r.instance
                r.failures, r.ejected_until, r.healthy, r.reason = 0, 0.0, True, None
                r.preflight_failed = False
                return r
        replica = Replica(url, instance)
        self.replicas.append(replica)
        return replica

    def remove(self, *, instance: str | None = None, url: str | None = None) -> bool:
        before = len(self.replicas)
        self.replicas = [
            r
            for r in self.replicas
            if not ((instance and r.instance == instance) or (url and r.url == _clean(url)))
        ]
        return len(self.replicas) != before

    # --- choice ----------------------------------------------------------------------------
    def choose(
        self, exclude: set[str] | frozenset[str] = frozenset(), prefer: str | None = None
    ) -> Replica | None:
        """``prefer`` when it can take the request, else the usable replica with the fewest
        requests in flight (None: none has room)."""
        now = self._clock()
        cap = self.policy.max_concurrency
        options = [
            r
            for r in self.replicas
            if r.url not in exclude and r.usable(now) and not (cap and r.outstanding >= cap)
        ]
        if not options:
            return None
        preferred = [r for r in options if r.url == prefer]
        return (
            preferred[0] if preferred else min(options, key=lambda r: (r.outstanding, r.last_used))
        )

    def unavailable(self, exclude: set[str] | frozenset[str] = frozenset()) -> ServiceUnavailable:
        """The 503 that says why no replica can take the request, and when to retry."""
        now = self._clock()
        if not self.replicas:
            why = "no replica is registered (POST /v1/gateway/register or list base_urls)"
        else:
            why = "; ".join(
                f"{r.url}: {'tried' if r.url in exclude else r.reason or 'unhealthy'}"
                for r in self.replicas
            )
        back = [r.ejected_until - now for r in self.replicas if r.ejected(now) and r.healthy]
        retry = min([self.policy.retry_after, *back]) if back else self.policy.retry_after
        return ServiceUnavailable(
            f"no healthy upstream replica for {self.model!r} ({why}); retry shortly",
            retry_after=max(1.0, retry),
            code="upstream_unavailable",
        )

    def admit(self) -> None:
        """Count one request in (429 when ``max_queued`` are already admitted)."""
        if self.admitted >= self.policy.max_queued:
            raise Overloaded(
                f"{self.admitted} requests are already queued for {self.model!r} "
                "(limits.max_queued_requests in the registry, or VLMSERVE_MAX_QUEUED_REQUESTS); "
                "retry later",
                retry_after=1.0,
            )
        self.admitted += 1

    def leave(self) -> None:
        self.admitted = max(0, self.admitted - 1)

    async def take(
        self, exclude: set[str] | frozenset[str] = frozenset(), prefer: str | None = None
    ) -> Replica:
        """A replica slot for one attempt (waits while every usable replica is at its cap);
        503 when no replica is usable at all."""
        while True:
            replica = self.choose(exclude, prefer)
            if replica is not None:
                replica.outstanding += 1
                replica.requests += 1
                replica.last_used = self._clock()
                return replica
            now = self._clock()
            if not any(r.url not in exclude and r.usable(now) for r in self.replicas):
                raise self.unavailable(exclude)
            self._freed = self._freed or asyncio.Event()
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), 1.0)

    def give(self, replica: Replica) -> None:
        replica.outstanding = max(0, replica.outstanding - 1)
        if self._freed is not None:
            self._freed.set()

    # --- outcomes --------------------------------------------------------------------------
    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        if not replica.ejected(self._clock()):
            replica.reason = None if replica.healthy else replica.reason

    def failed(self, replica: Replica, reason: str) -> None:
        """One failure; ``max_failures`` in a row eject the replica for ``eject_seconds``."""
        replica.failures += 1
        replica.reason = reason
        if replica.failures >= self.policy.max_failures:
            replica.ejected_until = self._clock() + self.policy.eject_seconds
            replica.failures = 0
            replica.reason = f"ejected after {self.policy.max_failures} failures: {reason}"

    def checked(self, replica: Replica, ok: bool, reason: str | None = None) -> None:
        """The result of an active health check."""
        replica.healthy = ok
        if ok:
            if not replica.ejected(self._clock()) and not replica.preflight_failed:
                replica.reason = None
        else:
            replica.reason = reason or "health check failed"

    def preflight(self, replica: Replica, ok: bool, reason: str | None = None) -> None:
        replica.preflight_failed = not ok
        if not ok:
            replica.reason = f"preflight failed: {reason}"
        elif replica.reason and replica.reason.startswith("preflight"):
            replica.reason = None

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [r.describe(now) for r in self.replicas]

    @property
    def healthy_count(self) -> int:
        now = self._clock()
        return sum(1 for r in self.replicas if r.usable(now))
