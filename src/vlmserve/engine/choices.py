"""Several one-choice streams as one ``n`` > 1 stream.

An ``n`` > 1 stream that has to go on after a failure (a restarted server continuing a stored
stream, the Ray ingress after its model replica died) cannot be continued as one request: its
choices' tokens are not one prefix. Each unfinished choice goes on as a request of its own
(``n`` = 1, ``seed + i``: what choice ``i`` samples with, ``SamplingParams.choice_seed``, and
its own tokens as the prefix), opened by ``open_choices``, and ``merge_choices`` puts their
chunks back under each choice's index.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from typing import TypeVar

from vlmserve.engine.types import Chunk

__all__ = ["merge_choices", "open_choices"]

T = TypeVar("T")


async def open_choices(
    n: int,
    ended: Container[int],
    open_one: Callable[[int], Awaitable[T]],
    abandon: Callable[[T], Awaitable[object]],
) -> list[tuple[int, T]]:
    """``(i, open_one(i))`` for each of the ``n`` choices not in ``ended``, in index order.
    When one fails to open, those already opened are abandoned and the error raised."""
    opened: list[tuple[int, T]] = []
    try:
        for i in range(n):
            if i not in ended:
                opened.append((i, await open_one(i)))
    except BaseException:
        for _, item in opened:
            await abandon(item)
        raise
    return opened


async def merge_choices(streams: list[tuple[int, AsyncIterator[Chunk]]]) -> AsyncIterator[Chunk]:
    """The chunks of several one-choice streams as they come, each under its choice's index.
    The first error ends the merge (the others are closed); closing it closes them all."""
    queue: asyncio.Queue[Chunk | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put(dataclasses.replace(chunk, index=index))
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in streams]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
