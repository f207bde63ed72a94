"""Send prebuilt chat bodies to a server, at most C in flight, and report as the load tester.

Like ``vllm bench serve`` without a request rate: every request is queued at once, a semaphore
caps those in flight, and each is timed from its own send by ``vlmserve.client.stream``
(TTFT, the gaps between token chunks, end to end); ``vlmserve.client.stats`` summarises.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from vlmserve.client.http import open_client
from vlmserve.client.stats import LoadReport, build_report
from vlmserve.client.stream import stream_chat

__all__ = ["drive"]


async def drive(
    url: str, bodies: list[dict[str, Any]], concurrency: int, transport: Any = None
) -> LoadReport:
    """``bodies`` streamed to ``url`` with at most ``concurrency`` in flight (``transport``:
    e.g. ``servers.BodyRewrite``); the load report."""
    slots = asyncio.Semaphore(concurrency)
    client = open_client(
        url, api_key=None, timeout=600.0, transport=transport, connections=concurrency
    )

    async def one(body: dict[str, Any]) -> Any:
        async with slots:
            return await stream_chat(client, body)

    async with client:
        started = time.perf_counter()
        records = await asyncio.gather(*(one(b) for b in bodies))
        duration = time.perf_counter() - started
    return build_report(records, duration, config={"concurrency": concurrency})
