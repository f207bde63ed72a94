"""Where the streams passed through this gateway live: session id (or completion id) -> the
model's backend and the replica holding it, so resumes and cancels reach that replica.

Entries expire ``ttl`` seconds after they were added (the sessions' own TTL) and the oldest
go first past ``max_entries``. Each is its client's API key's: another key's lookup finds
nothing, and its request goes on to the gateway's own path, which answers an unknown id's 404.
The map is this process's memory: after a gateway restart a resume of an older passed stream
is a 404, as a stream of the gateway's own memory store is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PassedStream", "PassedStreams"]


@dataclass(slots=True, frozen=True)
class PassedStream:
    backend: Any  # the model's UpstreamBackend
    replica_url: str
    rename: tuple[bytes, bytes] | None  # the upstream's "model" value -> the entry's name
    expires: float
    owner: str = ""  # the API key digest of the client that started it (auth's owner)


class PassedStreams:
    def __init__(
        self, ttl: float, max_entries: int = 65_536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._by_id: dict[str, PassedStream] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(
        self,
        names: list[str],
        backend: Any,
        replica_url: str,
        rename: tuple[bytes, bytes] | None = None,
        owner: str = "",
    ) -> None:
        """Route each of ``names`` (the session id, the completion id) to the replica."""
        now = self._clock()
        entry = PassedStream(backend, replica_url, rename, now + self.ttl, owner)
        for name in names:
            self._by_id.pop(name, None)  # re-added names move to the end (the newest)
            self._by_id[name] = entry
        self._trim(now)

    def get(self, name: str, owner: str = "") -> PassedStream | None:
        """The stream named ``name`` if ``owner`` started it (another's is unknown)."""
        entry = self._by_id.get(name)
        if entry is None or entry.expires <= self._clock() or entry.owner != owner:
            return None
        return entry

    def _trim(self, now: float) -> None:
        while self._by_id:
            oldest = next(iter(self._by_id))
            if len(self._by_id) <= self.max_entries and self._by_id[oldest].expires > now:
                return
            del self._by_id[oldest]
