"""A step's outputs on their way to the consumers' event loops.

The engine thread collects ``(sequence, item)`` pairs during a step (chunks, an error,
``END``); ``flush`` hands them to each event loop with **one** ``call_soon_threadsafe``
(not one per token), where ``deliver`` puts them on the consumers' queues in order.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vlmserve.engine.coalesce import END
from vlmserve.engine.core.sequence import Sequence

__all__ = ["END", "Outbox", "deliver"]


def deliver(items: list[tuple[Any, Any]]) -> None:
    """On the event loop: put each item on its queue."""
    for queue, item in items:
        queue.put_nowait(item)


class Outbox:
    def __init__(self) -> None:
        self.items: list[tuple[Sequence, Any]] = []

    def put(self, seq: Sequence, item: Any) -> None:
        self.items.append((seq, item))

    def clear(self) -> None:
        self.items = []

    def flush(self) -> list[Sequence]:
        """Deliver everything collected; return the sequences whose ``END`` went out."""
        if not self.items:
            return []
        by_loop: dict[Any, list[tuple[Any, Any]]] = {}
        out, self.items = self.items, []
        for seq, item in out:
            by_loop.setdefault(seq.loop, []).append((seq.queue, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(deliver, items)
        return [seq for seq, item in out if item is END]
