"""Which SSE wire a client gets, and that both number events the same (in-process, tiny model).

Default: OpenAI's wire (``data:`` lines only), parsed here the way vLLM's benchmark client does.
Asked for (``Accept: text/event-stream``, ``stream_options.resumable``, Last-Event-ID, GET
/v1/streams): ``id:`` lines too. Resuming where nothing follows is a 204, never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from sse_client import RESUMABLE, without_token
from support import MODEL
from vlmserve.client.stream import stream_chat
from vlmserve.engine.core import engine as engine_module
from vlmserve.engine.types import FinishReason
from vlmserve.gateway.upstream_wire import ChunkReader


def body(max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def vllm_bench_parse(raw: bytes) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """What ``vllm bench serve --backend openai-chat`` does with a response body: split it on
    blank lines, skip ``:`` comments, strip ``data: ``, json.loads the rest, stop at [DONE].
    Returns (chunks, text, usage)."""
    chunks: list[dict[str, Any]] = []
    text, usage = "", None
    for message in raw.decode("utf-8").split("\n\n"):
        message = message.strip()
        if not message or message.startswith(":"):
            continue
        payload = message.removeprefix("data: ")
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)  # an `id:` line in front makes this raise
        chunks.append(chunk)
        if choices := chunk.get("choices"):
            text += choices[0]["delta"].get("content") or ""
        elif chunk.get("usage"):
            usage = chunk["usage"]
    return chunks, text, usage


def messages(raw: bytes) -> list[list[str]]:
    """The SSE messages of a body, each as its lines."""
    return [m.split("\n") for m in raw.decode("utf-8").split("\n\n") if m]


def data_of(raw: bytes) -> list[str]:
    return [m[-1].removeprefix("data: ") for m in messages(raw)]


async def test_default_stream_has_only_data_lines_and_a_session_header(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/chat/completions", json=body())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-session-id"]
    lines = [line for line in r.text.split("\n") if line]
    assert lines and all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    ("headers", "options"),
    [
        ({"Accept": "text/event-stream"}, None),
        ({"Accept": "application/json, text/event-stream;q=0.5"}, None),
        ({}, {"resumable": True}),
        ({"Accept": "application/json"}, {"resumable": True}),
    ],
)
async def test_clients_that_ask_get_id_lines(
    client: httpx.AsyncClient, headers: dict[str, str], options: dict[str, Any] | None
) -> None:
    r = await client.post(
        "/v1/chat/completions", json=body(stream_options=options), headers=headers
    )
    sid = r.headers["x-session-id"]
    ids = [m[0] for m in messages(r.content)]
    assert ids == [f"id: {sid}:{i}" for i in range(len(ids))]


@pytest.mark.parametrize(
    ("headers", "options"),
    [
        ({"Accept": "application/json"}, None),  # the openai SDK
        ({"Accept": "*/*"}, None),  # httpx, curl, aiohttp (vLLM's benchmark), LiteLLM
        ({"Accept": "text/event-stream;q=0"}, None),
        ({"Accept": "text/event-stream"}, {"resumable": False}),
    ],
)
async def test_other_clients_get_the_openai_wire(
    client: httpx.AsyncClient, headers: dict[str, str], options: dict[str, Any] | None
) -> None:
    r = await client.post(
        "/v1/chat/completions", json=body(stream_options=options), headers=headers
    )
    assert all(line.startswith("data: ") for line in r.text.split("\n") if line)


async def test_vllm_benchmark_parser_reads_every_chunk_and_the_usage(
    client: httpx.AsyncClient,
) -> None:
    options = {"include_usage": True}
    r = await client.post("/v1/chat/completions", json=body(8, stream_options=options))
    full = await client.post("/v1/chat/completions", json={**body(8), "stream": False})
    chunks, text, usage = vllm_bench_parse(r.content)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len(chunks) == len(messages(r.content)) - 1  # all but [DONE]
    assert text == full.json()["choices"][0]["message"]["content"]
    # the same counts; cache hits differ (the second request finds the first one's prefix)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: usage[k] for k in counts} == {k: full.json()["usage"][k] for k in counts}
    assert usage["completion_tokens"] == 8


async def test_both_wires_number_the_same_events(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = await client.post("/v1/chat/completions", json=body(7, stream_options=options))
    sid = r.headers["x-session-id"]
    plain = [without_token(data) for data in data_of(r.content)]
    replay = await client.get(f"/v1/streams/{sid}")
    ids = [m[0] for m in messages(replay.content)]
    assert data_of(replay.content) == plain  # the same events in the same order
    assert ids == [f"id: {sid}:{i}" for i in range(len(plain))]  # index = messages before it
    assert plain[-1] == "[DONE]"  # [DONE] has its own index: len(plain) - 1
    for k in range(1, len(plain)):  # saw k messages -> resume after index k-1
        rest = await client.post(
            "/v1/chat/completions", json=body(7), headers={"Last-Event-ID": f"{sid}:{k - 1}"}
        )
        assert data_of(rest.content) == plain[k:]


async def test_grouped_tokens_are_one_event_with_one_index(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load (4+ rows decoding) tokens arrive ``stream_interval`` at a time, one event
    per group; the index counts events, not tokens."""
    monkeypatch.setattr(engine_module, "GROUP_WAIT_S", 60.0)  # group by steps alone
    client = await make_client(stream_interval=4)
    options = {"include_usage": True, "continuous_usage_stats": True}
    streams = await asyncio.gather(
        *(
            client.post("/v1/chat/completions", json=body(48, stream_options=options))
            for _ in range(6)
        )
    )
    grouped = 0
    for r in streams:
        payloads = [json.loads(d) for d in data_of(r.content)[:-1]]
        counts = [p["usage"]["completion_tokens"] for p in payloads[1:-2]]  # content events
        assert counts[-1] == 48 and counts == sorted(counts)
        grouped += len(counts) < 48
        replay = await client.get(f"/v1/streams/{r.headers['x-session-id']}")
        assert len(messages(replay.content)) == len(payloads) + 1  # same count on both wires
    assert grouped, "no stream had grouped tokens: the engine never got busy"


async def test_resuming_at_the_end_is_204_for_get_and_post(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=body(3))
    sid, last = r.headers["x-session-id"], len(messages(r.content)) - 1
    for after in (last, last + 1, last + 1000):
        event_id = f"{sid}:{after}"
        get = await client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": event_id})
        query = await client.get(f"/v1/streams/{sid}", params={"last_event_id": event_id})
        post = await client.post(
            "/v1/chat/completions", json=body(3), headers={"Last-Event-ID": event_id}
        )
        for answer in (get, query, post):
            assert answer.status_code == 204 and answer.content == b""
            assert answer.headers["x-session-id"] == sid
    before = await client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": f"{sid}:{last - 1}"})
    assert data_of(before.content) == ["[DONE]"]


async def test_an_index_ahead_of_a_running_stream_waits_for_its_events(
    client: httpx.AsyncClient,
) -> None:
    """A client that resumes ahead of the producer (it was told of an index the stream has not
    reached yet) gets the events after it once they are made, as a live listener does; one
    that the stream never reaches ends with the 204 of a finished stream."""
    sid = "wire-running"
    stream = asyncio.ensure_future(
        client.post("/v1/chat/completions", json=body(40, session_id=sid), headers=RESUMABLE)
    )
    try:
        for _ in range(600):
            ahead = await client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": f"{sid}:30"})
            if ahead.status_code != 404:
                break
            await asyncio.sleep(0.01)  # 404 until the session exists
        assert ahead.status_code == 200
        ids = [m[0] for m in messages(ahead.content)]
        assert ids[0] == f"id: {sid}:31" and data_of(ahead.content)[-1] == "[DONE]"
        never = await client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": f"{sid}:9999"})
        assert never.status_code == 204 and never.content == b""
    finally:
        r = await asyncio.wait_for(stream, 60)
    whole = messages(r.content)
    assert [m[0] for m in whole[31:]] == ids


@pytest.mark.parametrize("headers", [{}, RESUMABLE], ids=["openai-wire", "resumable-wire"])
async def test_gateway_reader_and_load_client_read_either_wire(
    client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    options = {"include_usage": True}
    r = await client.post(
        "/v1/chat/completions", json=body(5, stream_options=options), headers=headers
    )
    full = (await client.post("/v1/chat/completions", json={**body(5), "stream": False})).json()
    reader = ChunkReader()
    chunks = [c for line in r.text.split("\n") for c in reader.feed(line)]
    assert "".join(c.text for c in chunks) == full["choices"][0]["message"]["content"]
    assert chunks[-1].finish_reason is FinishReason.LENGTH and reader.done
    assert chunks[-1].prompt_tokens == full["usage"]["prompt_tokens"]
    assert chunks[-1].completion_tokens == 5
    client.headers.update(headers)
    record = await stream_chat(client, body(5, stream_options=options))
    assert record.ok and record.usage_seen and record.output_tokens == 5, record.message
