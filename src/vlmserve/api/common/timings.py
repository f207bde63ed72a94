"""Per-request timings: where one generation's time went, for its answer and for ``/metrics``.

vLLM (``--enable-per-request-metrics``) answers a top-level ``metrics`` object with
``time_to_first_token_ms`` (from admission to the first token), ``generation_time_ms`` (first
to last token), ``queue_time_ms``, ``mean_itl_ms`` and ``tokens_per_second`` (all tokens over
admission to last token), on non-streamed answers and on a stream's final usage chunk, for
single-choice requests. The same object is answered here, with what an image request needs
on top: ``media_ms`` (the body read and validated, media fetched and decoded, the prompt
templated and preprocessed),
``vision_ms`` (the prompt embedded, vision tower included), ``prefill_ms`` (the rest until the
first token) and ``e2e_ms`` (arrival to last token, as the server saw it). ``media_ms +
queue_time_ms + vision_ms + prefill_ms + generation_time_ms`` is the request's time in the
server, phase by phase.

On with ``--per-request-metrics`` (``VLMSERVE_PER_REQUEST_METRICS``) for every
request, or per request with the body field ``"include_metrics": true``. A non-streamed chat
answer always carries them as a ``Server-Timing`` header (durations in milliseconds).
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "RequestClock", "arrived_now", "metrics_object", "server_timing"]

PHASES = ("media", "queue", "vision", "prefill", "decode", "e2e")
# When the HTTP request being served arrived, and the task serving it (set by the outermost
# middleware): its body's reading and validation count in ``media``. Other tasks (a batch's
# lines, a resumed stream) inherit the value but not the task: their clock starts when the
# generation is opened.
ARRIVED: ContextVar[tuple[asyncio.Task[Any] | None, float] | None] = ContextVar(
    "vlmserve_arrived", default=None
)


def arrived_now() -> None:
    """Mark the HTTP request of the current task as arrived (the middleware calls it)."""
    ARRIVED.set((_task(), time.perf_counter()))


def _task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def _arrived() -> float:
    arrived = ARRIVED.get()
    if arrived is None or arrived[0] is not _task():
        return time.perf_counter()
    return arrived[1]


@dataclass(slots=True)
class RequestClock:
    """The API's side of a generation's timeline (``time.perf_counter()``)."""

    opened: float = field(default_factory=_arrived)  # the request arrived
    prepared: float = 0.0  # media fetched and decoded, prompt built: the engine may start
    first: float = 0.0  # first token received
    last: float = 0.0  # latest token received

    def tokens(self, now: float) -> float:
        """New tokens arrived at ``now``: the seconds since the previous ones (0 for the first)."""
        gap = now - self.last if self.first else 0.0
        self.first, self.last = self.first or now, now
        return gap

    def phases(self, engine: dict[str, float] | None, now: float) -> dict[str, float]:
        """Seconds by phase (``PHASES``): the engine's when it timed them; else (a proxied
        model, ``model.generate``) prefill and decode as this side saw them."""
        start = self.prepared or self.opened
        if engine is None:
            first = self.first or now
            engine = {
                "queue": 0.0,
                "vision": 0.0,
                "prefill": first - start,
                "decode": (self.last or first) - first,
            }
        # An engine process starts a request before its answer to the prepare gets here: the
        # engine's phases then begin inside what this side saw as media, and media is cut to
        # what they leave of the whole, so the phases never add up to more than it.
        e2e = now - self.opened
        media = max(0.0, min(start - self.opened, e2e - sum(engine.values())))
        return {"media": media, **engine, "e2e": e2e}

    def time_to_first_token(self, now: float) -> float:
        """From arrival to the first token (to ``now`` when none came)."""
        return (self.first or now) - self.opened


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def metrics_object(timings: dict[str, float], completion_tokens: int) -> dict[str, Any]:
    """The answer's ``metrics`` (vLLM's fields, then ours) from ``Chunk.timings``."""
    ttft = timings["vision"] + timings["prefill"]
    inference = ttft + timings["decode"]
    itl = timings["decode"] / (completion_tokens - 1) if completion_tokens > 1 else None
    return {
        "time_to_first_token_ms": _ms(ttft),
        "generation_time_ms": _ms(timings["decode"]),
        "queue_time_ms": _ms(timings["queue"]),
        "mean_itl_ms": None if itl is None else _ms(itl),
        "tokens_per_second": round(completion_tokens / inference, 3) if inference > 0 else None,
        "media_ms": _ms(timings["media"]),
        "vision_ms": _ms(timings["vision"]),
        "prefill_ms": _ms(timings["prefill"]),
        "e2e_ms": _ms(timings["e2e"]),
    }


def server_timing(timings: dict[str, float]) -> str:
    """A ``Server-Timing`` header value: one ``name;dur=<ms>`` entry per phase."""
    return ", ".join(f"{name};dur={timings[name] * 1000:.1f}" for name in PHASES if name in timings)
