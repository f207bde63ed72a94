"""Client building blocks: URLs, media, request bodies, the SSE reader, the CLI's flag parsing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import subprocess
import sys

import av
import httpx
import pytest
import typer
from PIL import Image

from vlmserve.cli.loadtest import parse_size
from vlmserve.client.http import ServerUnreachable, error_text, normalize_base_url
from vlmserve.client.loadtest import LoadConfig, run_load
from vlmserve.client.media import noise_mp4, noise_png, pixel_png
from vlmserve.client.payload import build_bodies
from vlmserve.client.preflight import embeds
from vlmserve.client.stats import RequestRecord
from vlmserve.client.stream import carries_token, stream_chat


def decode(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("h:8000", "http://h:8000"),
        ("https://x.io/api/v1", "https://x.io/api"),
    ],
)
def test_base_urls_drop_a_trailing_v1_and_get_a_scheme(given: str, base: str) -> None:
    assert normalize_base_url(given) == base


def test_error_text_reads_the_openai_error_shape_and_hints_at_the_key() -> None:
    body = b'{"error": {"message": "no such model", "code": "model_not_found"}}'
    assert error_text(404, body) == "HTTP 404 model_not_found: no such model"
    assert error_text(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert "--api-key" in error_text(401, b'{"error": {"message": "missing key"}}')


def test_media_decodes_to_what_was_asked() -> None:
    assert Image.open(io.BytesIO(pixel_png())).size == (1, 1)
    image = Image.open(io.BytesIO(noise_png(40, 30, seed=1)))
    assert image.size == (40, 30) and image.mode == "RGB"
    assert noise_png(8, 8, seed=1) != noise_png(8, 8, seed=2)
    with av.open(io.BytesIO(noise_mp4(5, 32, 32))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)


def test_bodies_stream_with_usage_and_share_media_unless_distinct() -> None:
    common = {"model": "m", "requests": 3, "max_tokens": 7, "prompt_words": 5, "seed": 1}
    shared = build_bodies(**common, ignore_eos=True, image=(16, 16))
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in shared)
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 7 for b in shared)
    parts = [b["messages"][0]["content"] for b in shared]
    assert parts[0][0]["image_url"]["url"] is parts[2][0]["image_url"]["url"]  # one object
    assert len(parts[0][1]["text"].split()) == 5 and parts[0][1] != parts[1][1]
    distinct = build_bodies(
        **common, ignore_eos=False, image=(16, 16), video_frames=2, distinct_media=True
    )
    urls = [b["messages"][0]["content"][0]["image_url"]["url"] for b in distinct]
    assert len(set(urls)) == 3 and "ignore_eos" not in distinct[0]
    assert distinct[0]["messages"][0]["content"][1]["type"] == "video_url"
    assert Image.open(io.BytesIO(decode(urls[0]))).size == (16, 16)
    text_only = build_bodies(**common, ignore_eos=True)
    assert isinstance(text_only[0]["messages"][0]["content"], str)
    assert build_bodies(**common, ignore_eos=True) == text_only  # seeded: reproducible


def test_only_chunks_with_generated_output_count_as_tokens() -> None:
    def chunk(delta: dict) -> dict:
        return {"choices": [{"index": 0, "delta": delta}]}

    assert not carries_token(chunk({"role": "assistant", "content": ""}))  # the opener
    assert carries_token(chunk({"role": "assistant", "content": "Hi"}))
    assert carries_token(chunk({"role": "assistant", "reasoning_content": "hm"}))  # a first
    assert carries_token(chunk({"content": ""}))  # a token whose bytes are held back
    assert carries_token(chunk({"reasoning_content": "hm"}))
    assert not carries_token(chunk({}))  # the finish chunk
    assert not carries_token({"choices": [], "usage": {"completion_tokens": 3}})


def sse(*events: str) -> bytes:
    return "".join(f"{e}\n\n" for e in events).encode()


def data(delta: dict | None = None, usage: dict | None = None) -> str:
    body: dict = {"choices": [{"index": 0, "delta": delta}] if delta is not None else []}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}"


async def read(payload: bytes, status: int = 200) -> RequestRecord:
    transport = httpx.MockTransport(lambda _: httpx.Response(status, content=payload))
    async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
        return await stream_chat(client, {"model": "m"})


async def test_the_stream_reader_times_tokens_and_takes_counts_from_usage() -> None:
    record = await read(
        sse(
            data({"role": "assistant", "content": ""}),
            data({"content": "a"}),
            data({"content": "b"}),
            data({"content": "c"}),
            data({}),
            data(usage={"prompt_tokens": 11, "completion_tokens": 5}),
            "data: [DONE]",
        )
    )
    assert record.ok and record.usage_seen
    assert (record.prompt_tokens, record.output_tokens) == (11, 5)
    assert len(record.itl) == 2 and 0 < record.ttft <= record.e2e


class Pieces(httpx.AsyncByteStream):
    """A body sent in the given pieces, ``pause`` seconds before each after the first."""

    def __init__(self, pieces: list[bytes], pause: float = 0.0):
        self.pieces, self.pause = pieces, pause

    async def __aiter__(self):  # type: ignore[override]
        for i, piece in enumerate(self.pieces):
            if i and self.pause:
                await asyncio.sleep(self.pause)
            yield piece


async def read_pieces(pieces: list[bytes], pause: float = 0.0) -> RequestRecord:
    transport = httpx.MockTransport(lambda _: httpx.Response(200, stream=Pieces(pieces, pause)))
    async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
        return await stream_chat(client, {"model": "m"})


async def test_the_stream_reader_takes_events_split_anywhere_and_crlf_lines() -> None:
    body = (
        "id: 0\r\n" + data({"role": "assistant", "content": "a"}) + "\r\n\r\n"
        ": keep-alive\n\n"
        + data({"content": "b"})
        + "\n\n"
        + data(usage={"prompt_tokens": 4, "completion_tokens": 2})
        + "\n\n"
        "data: [DONE]"  # no blank line after the last event
    ).encode()
    for size in (1, 2, 7, 64, len(body)):
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        record = await read_pieces(pieces)
        assert record.ok and record.usage_seen, size
        assert (record.prompt_tokens, record.output_tokens, len(record.itl)) == (4, 2, 1)


async def test_a_token_is_timed_when_its_bytes_arrive() -> None:
    first, second = data({"content": "a"}) + "\n\n", data({"content": "b"}) + "\n\n"
    record = await read_pieces([first.encode(), second.encode(), b"data: [DONE]\n\n"], 0.2)
    assert record.ok and record.output_tokens == 2
    assert record.ttft < 0.2 <= record.itl[0]


async def test_requests_one_after_another_share_one_connection() -> None:
    # The chunked body's last bytes come after [DONE], as a server's may: a reader that stops
    # at [DONE] closes the connection, and every next request pays for a new one in its TTFT.
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await _answer_each_request(reader, writer)

    async def _answer_each_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            await reader.readexactly(int(length[1]) if length else 0)  # the request's body
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
            for event in (data({"content": "a"}) + "\n\n", "data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event.encode()))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            records = [await stream_chat(client, {"model": "m"}) for _ in range(3)]
    finally:
        server.close()
    assert all(r.ok and r.output_tokens == 1 for r in records)
    assert connections == 1


async def test_the_stream_reader_records_errors_instead_of_raising() -> None:
    failed = await read(b'{"error": {"message": "busy", "code": "overloaded"}}', status=503)
    assert failed.error == "503" and "busy" in failed.message
    mid = await read(
        sse(data({"content": "a"}), 'event: error\ndata: {"error": {"message": "boom"}}')
    )
    assert mid.error == "stream_error" and "boom" in mid.message
    no_usage = await read(sse(data({"content": "a"}), data({"content": "b"}), "data: [DONE]"))
    assert no_usage.ok and not no_usage.usage_seen
    assert no_usage.output_tokens == 2


async def test_run_load_refuses_bad_settings_and_a_rejected_key_before_sending() -> None:
    with pytest.raises(ValueError, match="--concurrency must be > 0"):
        await run_load(LoadConfig("http://s", "m", concurrency=0))
    with pytest.raises(ValueError, match="--image width"):
        await run_load(LoadConfig("http://s", "m", image=(0, 5)))
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(401, json={"error": {"message": "invalid API key"}})

    with pytest.raises(ServerUnreachable, match="--api-key"):
        await run_load(
            LoadConfig("http://s", "m", requests=3), transport=httpx.MockTransport(handler)
        )
    assert sent == ["/v1/models"]  # no chat request went out


def test_image_sizes_parse_or_say_what_is_expected() -> None:
    assert parse_size("448x336") == (448, 336) and parse_size("64X64") == (64, 64)
    assert parse_size(None) is None
    for bad in ("448", "0x4", "ax4", "4x-1"):
        with pytest.raises(typer.BadParameter, match="WIDTHxHEIGHT"):
            parse_size(bad)


def test_the_client_package_imports_no_torch_transformers_or_fastapi() -> None:
    heavy = "('torch', 'transformers', 'fastapi')"
    code = (
        "import sys, vlmserve.client, vlmserve.cli.preflight, vlmserve.cli.loadtest; "
        f"print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_preflight_reads_embedding_capability_from_capabilities_then_roles() -> None:
    assert embeds({"id": "m", "capabilities": ["vision", "embedding"]}) is True
    assert (
        embeds({"id": "m", "capabilities": {"embedding": False}, "roles": ["embedding"]}) is False
    )
    assert embeds({"id": "m", "capabilities": None, "roles": ["chat"]}) is False
    assert embeds({"id": "m", "roles": ["embedding"]}) is True
    assert embeds({"id": "m", "owned_by": "vllm"}) is None  # not advertised: skipped, not failed
