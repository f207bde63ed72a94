"""TTFT of setups that take turns request by request.

Rounds of whole load tests (8 requests at c=1) give a TTFT p50 that moves by 1-2 ms between
rounds on a shared 2-core machine: more than the ~1 ms a proxy adds. Here every setup sends
one request in turn (the order rotating), so load that comes and goes hits each setup alike,
and each median is over ``n`` requests.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["added_ms", "interleaved_ttft"]


def _body(model: str) -> dict[str, Any]:
    """A streamed 64x64 image request of 4 tokens (TTFT is all that is timed)."""
    from vlmserve.testing.media import data_url, image_bytes

    image = data_url(image_bytes(64, 64), "image/png")
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "What is in this image?"},
    ]
    return {
        "model": model,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }


async def interleaved_ttft(urls: dict[str, str], n: int, model: str) -> dict[str, list[float]]:
    """TTFT (ms) of ``n`` one-at-a-time requests per setup (name -> base URL), the setups
    taking turns request by request."""
    import httpx

    body = _body(model)
    clients = {s: httpx.AsyncClient(base_url=u, timeout=120) for s, u in urls.items()}
    times: dict[str, list[float]] = {s: [] for s in urls}
    names = list(urls)
    try:
        for i in range(n):
            for setup in names[i % len(names) :] + names[: i % len(names)]:
                began = time.perf_counter()
                async with clients[setup].stream(
                    "POST", "/v1/chat/completions", json=body
                ) as response:
                    first = None
                    async for line in response.aiter_lines():  # read to the end: keep-alive
                        if first is None and '"delta":{"content"' in line:  # a token chunk
                            first = (time.perf_counter() - began) * 1000
                    if first is not None:
                        times[setup].append(first)
    finally:
        for client in clients.values():
            await client.aclose()
    return times


def added_ms(times: dict[str, list[float]], setup: str, base: str) -> float | None:
    """TTFT p50 of ``setup`` minus the baseline's (ms); None without samples of both."""
    if not times.get(setup) or not times.get(base):
        return None
    return statistics.median(times[setup]) - statistics.median(times[base])
