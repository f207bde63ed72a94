"""A consumer's side of a request's chunk queue: chunks until ``END``, merged when they pile up.

Shared by the in-process chat backend (``engine/hf/chat.py``) and the engine-process client
(``engine/proc/client.py``); torch-free.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from vlmserve.engine.types import Chunk

__all__ = ["END", "coalesced"]

END = object()  # the last item a consumer receives
MERGE_BACKLOG = 32  # chunks waiting for the consumer before they are merged into one
MERGE_CROWDED = 2  # the same while the engine decodes several streams


async def coalesced(queue: asyncio.Queue[Any], crowded: Callable[[], bool]) -> AsyncIterator[Chunk]:
    """The queue's chunks until END (exceptions re-raised), one token per chunk while the
    consumer keeps up. When chunks pile up they are merged into one, as vLLM's output
    collector does, so a saturated event loop pays one SSE event per wake-up instead of
    one per token and catches up: as soon as two are waiting while the engine decodes
    several streams (``crowded``), or once ``MERGE_BACKLOG`` are waiting for a lone one."""
    pending: Any = None
    while True:
        item = pending if pending is not None else await queue.get()
        pending = None
        if item is END:
            return
        if isinstance(item, BaseException):
            raise item
        waiting = queue.qsize()
        merge = waiting >= MERGE_BACKLOG or (waiting >= MERGE_CROWDED and crowded())
        while merge and not queue.empty() and item.finish_reason is None:
            nxt = queue.get_nowait()
            if not isinstance(nxt, Chunk) or nxt.index != item.index:  # n > 1: one choice each
                pending = nxt
                break
            item = item.merged(nxt)
        yield item
