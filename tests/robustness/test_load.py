"""Load and header floods against a real ``vlmserve serve`` process on loopback.

64 concurrent streaming clients for 10 s (60 s with --long) against a server whose queue bound
is 8: every answer is 200, 429 or 503 (no resets, no 5xx), the bound shows (some 429s, either as
HTTP status or as the stream's error event), and the server's RSS drifts by less than 10%
between the first and the last quarter of the run.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import Scale
from support import MODEL, ServerProcess

pytestmark = pytest.mark.robustness

QUEUE = 8
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 16,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--served-model-name",
            MODEL,
            "--device",
            "cpu",
            "--max-queued-requests",
            str(QUEUE),
        ]
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _send_raw(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            return s.recv(64)
        except OSError as exc:
            return repr(exc).encode()


def test_header_floods_do_no_harm(server: ServerProcess) -> None:
    pid = server.proc.pid
    rss0 = psutil.Process(pid).memory_info().rss
    floods = {
        "10000 headers": b"".join(b"X-H%d: v\r\n" % i for i in range(10000)),
        "1 MiB header": b"X-Big: " + b"a" * 2**20 + b"\r\n",
        "8 MiB header": b"X-Big: " + b"a" * 2**23 + b"\r\n",
    }
    answers = {name: _send_raw(server.port, head)[:12] for name, head in floods.items()}
    growth = (psutil.Process(pid).memory_info().rss - rss0) / 2**20
    print(f"\nheader floods: {answers}, RSS +{growth:.1f} MiB")
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert growth < 64


def test_one_mib_header_is_refused(server: ServerProcess) -> None:
    answer = _send_raw(server.port, b"X-Big: " + b"a" * 2**20 + b"\r\n")
    assert not answer.startswith(b"HTTP/1.1 200"), answer


async def _client(url: str, until: float, seen: Counter) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=15) as client:
        while time.monotonic() < until:
            try:
                async with client.stream("POST", "/v1/chat/completions", json=BODY) as r:
                    text = "".join([t async for t in r.aiter_text()])
                overloaded = '"code":"overloaded"' in text.replace(" ", "")
                seen[
                    "200_sse_overloaded" if r.status_code == 200 and overloaded else r.status_code
                ] += 1
            except httpx.TransportError as exc:
                seen[type(exc).__name__] += 1


async def _sample_rss(pid: int, until: float, out: list[int]) -> None:
    proc = psutil.Process(pid)
    while time.monotonic() < until:
        out.append(proc.memory_info().rss)
        await asyncio.sleep(0.25)


async def test_64_streams_get_only_200_429_503_and_rss_stays_flat(
    server: ServerProcess, scale: Scale
) -> None:
    seen: Counter = Counter()
    rss: list[int] = []
    until = time.monotonic() + scale.load_seconds
    await asyncio.gather(
        _sample_rss(server.proc.pid, until, rss),
        *(_client(server.url, until, seen) for _ in range(64)),
    )
    quarter = max(1, len(rss) // 4)
    first, last = statistics.mean(rss[:quarter]), statistics.mean(rss[-quarter:])
    drift = (last - first) / first
    total = sum(seen.values())
    print(
        f"\nload {scale.load_seconds:.0f}s x 64 streams: {dict(seen)} ({total} requests), "
        f"RSS {first / 2**20:.0f} -> {last / 2**20:.0f} MiB ({drift:+.1%})"
    )
    assert set(seen) <= {200, 429, 503, "200_sse_overloaded"}, seen
    assert seen[429] > 0, "the queue bound never showed as a 429"
    assert seen["200_sse_overloaded"] == 0, "a refused stream must be a 429, not a 200"
    assert seen[200] > 0
    assert abs(drift) < 0.10
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
