"""What one API key may share with another, and how much of the server it may hold at once.

- Prefix cache: with API keys configured, a local model's prompt blocks are salted by the
  caller's key digest (the engine's ``cache_salt``, a request's own salt appended), so a key
  shares cached blocks only with itself: no key can time another key's prompts by its cache
  hits. ``VLMSERVE_PREFIX_CACHE_SCOPE=global`` shares them between keys (one tenant, several
  keys). Without keys nothing is salted (a request's own ``cache_salt`` still applies).
- Concurrency: ``VLMSERVE_MAX_CONCURRENT_PER_KEY`` generations at once per key (streams,
  JSON answers, stored and background responses, from their admission to their last token);
  one more is a 429 with ``Retry-After``. 0 (the default) is no cap. A generation continued
  after a restart is never refused (it was admitted before), nor a batch line (batches run
  under ``VLMSERVE_BATCH_MAX_CONCURRENCY``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmserve.api.auth import ANONYMOUS
from vlmserve.errors import Overloaded

__all__ = ["KeyPolicy", "KeyedLease"]


def _nothing() -> None:
    pass


@dataclass(slots=True)
class KeyPolicy:
    keyed: bool = False  # API keys are configured
    prefix_scope: str = "key"  # "key": salted by key; "global": shared between keys
    max_concurrent: int = 0  # generations at once per key; 0 = no cap
    running: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Any) -> KeyPolicy:
        return cls(
            bool(settings.api_keys), settings.prefix_cache_scope, settings.max_concurrent_per_key
        )

    def salt(self, owner: str, given: str | None) -> str | None:
        """The engine's ``cache_salt`` for ``owner``'s request (``given``: the request's own)."""
        if not self.keyed or self.prefix_scope == "global" or owner == ANONYMOUS:
            return given
        return owner if given is None else f"{owner}:{given}"

    def take(self, owner: str) -> Callable[[], None]:
        """A place among ``owner``'s concurrent generations (its release, called once), or
        Overloaded (429) when the key has ``max_concurrent`` already."""
        if not self.keyed or self.max_concurrent <= 0:
            return _nothing
        count = self.running.get(owner, 0)
        if count >= self.max_concurrent:
            raise Overloaded(
                f"this API key already runs {count} generations, its limit "
                f"(VLMSERVE_MAX_CONCURRENT_PER_KEY={self.max_concurrent}); retry when one ends",
                code="key_concurrency_limit",
            )
        self.running[owner] = count + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.running[owner] - 1  # held since take: never below 0
                if left > 0:
                    self.running[owner] = left
                else:
                    del self.running[owner]

        return release


class KeyedLease:
    """A model lease that also holds a key's place (``KeyPolicy.take``): both are released
    together, when the generation ends."""

    __slots__ = ("_lease", "_place")

    def __init__(self, lease: Any, place: Callable[[], None]) -> None:
        self._lease, self._place = lease, place

    @property
    def backend(self) -> Any:
        return self._lease.backend

    def release(self) -> None:
        try:
            self._lease.release()
        finally:
            self._place()
