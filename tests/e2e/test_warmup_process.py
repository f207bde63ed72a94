"""Warm-up on the real server process (engine process, the default): once ``/ready`` says
200 the first user request is as fast as the later ones, because the model already
answered a text and an image request of its own; the time is logged."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import ServerProcess
from vlmserve.testing.media import data_url, image_bytes

pytestmark = pytest.mark.slow


def serve(tiny_dir: Path, *extra: str) -> ServerProcess:
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    return ServerProcess([*args, *extra], engine_process=True)


def ttfts(server: ServerProcess, count: int) -> list[float]:
    """Seconds to the first answer token of ``count`` streamed image requests, one by one,
    each with its own picture, size and question (no cache of an earlier one helps it, and
    each is a new shape for the vision tower, as users' pictures are); the connection is
    opened first (a client's cost, not the server's)."""
    out = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/v1/models").raise_for_status()
        for i in range(count):
            picture = data_url(image_bytes(280 + 28 * i, 224, seed=i + 1), "image/png")
            content = [
                {"type": "image_url", "image_url": {"url": picture}},
                {"type": "text", "text": f"What is in picture {i}?"},
            ]
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
            }
            out.append(_first_token(client, body))
    return out


def _first_token(client: httpx.Client, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - started
    assert first is not None
    return first


@pytest.fixture(scope="module")
def warmed(tiny_dir: Path) -> Iterator[ServerProcess]:
    server = serve(tiny_dir)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_first_request_after_ready_is_as_fast_as_the_later_ones(
    warmed: ServerProcess,
) -> None:
    times = ttfts(warmed, 10)
    later = statistics.median(times[4:10])
    shown = [round(t * 1000) for t in times]
    assert times[0] <= 2 * later, f"TTFTs {shown} ms: the first is over twice the median of 5-10"
    assert "warmed up in" in warmed.output()  # the time is logged
