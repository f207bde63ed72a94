"""Media by reference: decoded media kept under the ``uuid`` its part carried.

A part sent with data and a ``uuid`` (vLLM's per-item id) is kept, decoded, under (API key,
uuid); a later request of the same key may send the part with the ``uuid`` alone and gets it
back without fetching or decoding it again (its processed pixels then hit the processor and
vision caches, whose keys are the pixels). Another key's uuid is exactly an unknown one.

An entry is kept ``VLMSERVE_MEDIA_UUID_TTL`` minutes after its last use (each use renews it);
within ``VLMSERVE_MEDIA_UUID_CACHE_BYTES`` the least recently used go first. An unknown or
expired uuid is a 400 that says to send the data again; a uuid-only part whose processing
options (``detail``, ``mm_processor_kwargs``, frame choice) differ from those it was kept with
is a 400 too: the same uuid must mean the same model input.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from vlmserve.engine.types import ImagePart, Part
from vlmserve.errors import InvalidRequest

__all__ = ["MediaRefs"]


@dataclass(slots=True)
class _Held:
    part: Part
    options: str
    nbytes: int
    expires: float


def _nbytes(part: Part) -> int:
    images = [part.image] if isinstance(part, ImagePart) else getattr(part, "frames", [])
    return sum(im.width * im.height * len(im.getbands()) for im in images)


class MediaRefs:
    """Per-key uuid -> decoded part, with a lifetime after last use and a byte budget."""

    def __init__(
        self, ttl_seconds: float, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ):
        self.ttl, self.max_bytes, self.clock = ttl_seconds, max_bytes, clock
        self._held: OrderedDict[tuple[str, str], _Held] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.stored = 0

    def put(self, owner: str, uuid: str, part: Part, options: str) -> None:
        nbytes = _nbytes(part)
        if self.max_bytes <= 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._held.pop((owner, uuid), None)
            if old is not None:
                self.bytes -= old.nbytes
            self._held[(owner, uuid)] = _Held(part, options, nbytes, self.clock() + self.ttl)
            self.bytes += nbytes
            self.stored += 1
            self._evict()

    def get(self, owner: str, uuid: str, options: str, where: str) -> Part:
        """The part kept under ``uuid`` (renewed); 400 when unknown, expired or kept with
        other processing options."""
        with self._lock:
            self._evict()
            held = self._held.get((owner, uuid))
            if held is None:
                self.misses += 1
                raise InvalidRequest(
                    f"media uuid {uuid!r} is unknown or has expired (kept "
                    f"{self.ttl / 60:g} minutes after last use, VLMSERVE_MEDIA_UUID_TTL); "
                    "send the data again with the uuid",
                    param=where,
                    code="media_uuid_unknown",
                )
            if held.options != options:
                raise InvalidRequest(
                    f"media uuid {uuid!r} was processed with other options (detail, "
                    "mm_processor_kwargs or frame sampling); send the same options or the "
                    "data again",
                    param=where,
                    code="media_uuid_options",
                )
            held.expires = self.clock() + self.ttl
            self._held.move_to_end((owner, uuid))
            self.hits += 1
            return held.part

    def _evict(self) -> None:
        now = self.clock()
        for key in [k for k, h in self._held.items() if h.expires <= now]:
            self.bytes -= self._held.pop(key).nbytes
        while self.bytes > self.max_bytes and self._held:
            _, evicted = self._held.popitem(last=False)
            self.bytes -= evicted.nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "stored": self.stored,
                "bytes": self.bytes,
                "entries": len(self._held),
            }
