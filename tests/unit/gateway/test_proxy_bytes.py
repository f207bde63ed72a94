"""The gateway reads upstream streams as raw bytes: the chunks it makes do not depend on where
the network splits the body, on the line ends the upstream uses, or on compression."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from upstreams import fake_upstreams
from vlmserve.engine.types import Chunk, GenerateRequest, SamplingParams
from vlmserve.errors import VlmserveError
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.gateway.upstream_wire import ChunkReader

pytestmark = pytest.mark.timeout(30)


def _sse(texts: list[str], line_end: str = "\n") -> bytes:
    events = [
        {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {"content": t}}]} for t in texts
    ]
    events.append(
        {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    )
    events.append(
        {
            "id": "chatcmpl-up",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(texts)},
        }
    )
    parts = [": keep-alive", *(f"data: {json.dumps(e)}" for e in events), "data: [DONE]"]
    return "".join(p + line_end * 2 for p in parts).encode()


def _summary(chunks: list[Chunk]) -> list[tuple[Any, ...]]:
    return [(c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens) for c in chunks]


TEXTS = ["Hél", "lo ", "wörld", " ✓"]  # multi-byte characters: a split can cut one in two


def _by_lines(body: bytes) -> list[Chunk]:
    reader = ChunkReader()
    return [c for line in body.decode().split("\n") for c in reader.feed(line)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_any_split_of_the_body_gives_the_same_chunks(size: int) -> None:
    body = _sse(TEXTS)
    reader = ChunkReader()
    chunks = [c for i in range(0, len(body), size) for c in reader.feed_bytes(body[i : i + size])]
    chunks += reader.close()
    assert _summary(chunks) == _summary(_by_lines(body))
    assert [c.text for c in chunks][:4] == TEXTS and chunks[-1].completion_tokens == 4


@pytest.mark.parametrize("line_end", ["\r\n", "\r"])
def test_crlf_and_cr_line_ends_read_like_lf(line_end: str) -> None:
    reader = ChunkReader()
    chunks = reader.feed_bytes(_sse(TEXTS, line_end)) + reader.close()
    assert _summary(chunks) == _summary(_by_lines(_sse(TEXTS)))


def test_a_last_line_without_its_line_end_is_still_read() -> None:
    body = _sse(TEXTS).rstrip(b"\n")  # ends in "data: [DONE]" with no newline
    reader = ChunkReader()
    chunks = reader.feed_bytes(body) + reader.close()
    assert chunks[-1].finish_reason is not None and reader.done


def test_an_error_event_split_across_reads_raises() -> None:
    body = b'event: error\ndata: {"error": {"message": "boom", "type": "server_error"}}\n\n'
    reader = ChunkReader()
    reader.feed_bytes(body[:9])
    with pytest.raises(VlmserveError, match="boom"):
        reader.feed_bytes(body[9:])


class _Pieces(httpx.AsyncByteStream):
    """A streamed body, a few bytes at a time (each its own write on the socket)."""

    def __init__(self, body: bytes, size: int = 5):
        self.body, self.size = body, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.body), self.size):
            yield self.body[i : i + self.size]


async def _proxied(handler: Any) -> list[Chunk]:
    async with fake_upstreams(handler, "http://a.test") as fake:
        config = UpstreamConfig(
            model="up", base_urls=fake.real("http://a.test"), health_interval=0, preflight=False
        )
        backend = UpstreamBackend("gw", config)
        await backend.aload()
        try:
            raw = {"model": "gw", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}
            prepared = await backend.prepare(GenerateRequest("r", [], SamplingParams(), raw=raw))
            return [c async for c in backend.generate(prepared)]
        finally:
            await backend.aclose()


async def test_streamed_upstream_body_is_read_raw_and_asked_uncompressed() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        seen.append(request)
        return httpx.Response(200, stream=_Pieces(_sse(TEXTS)))

    chunks = await _proxied(handler)
    assert [c.text for c in chunks][:4] == TEXTS
    assert seen[0].headers["accept-encoding"] == "identity"
    assert json.loads(seen[0].content)["seed"] == 2**70  # wider than orjson takes: still sent


async def test_a_compressed_upstream_body_is_decoded() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        headers = {"content-encoding": "gzip"}
        return httpx.Response(200, headers=headers, stream=_Pieces(gzip.compress(_sse(TEXTS))))

    chunks = await _proxied(handler)
    assert [c.text for c in chunks][:4] == TEXTS and chunks[-1].completion_tokens == 4
