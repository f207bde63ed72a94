"""Stop strings across streamed text: emit nothing that could still become a stop string."""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, stopped). On a stop the stop string is dropped."""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return "", False
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
