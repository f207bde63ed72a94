"""A stream's first chunk is its first token's (the assistant role in the same delta, as vLLM
sends it), on both wires and through a stored stream's replay; its headers still go out at
once. Clients that time the first chunk (``vllm bench serve`` among them) then measure the
time to the first token, not to a role chunk sent before the prompt was prefilled."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from sse_client import RESUMABLE, SSEEvent, iter_events, without_token
from support import MODEL

LONG = "The sea is wide and the ships are many. " * 120  # ~1,200 tokens: a measurable prefill


def _body(**extra: Any) -> dict[str, Any]:
    # a prompt of its own: the loaded model is shared between tests, and a cached prefix
    # would leave the prefill too short to tell the headers from the first chunk
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {LONG}"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "include_metrics": True,
        **extra,
    }


def _timed_stream(url: str, resumable: bool) -> tuple[float, float, list[SSEEvent], str]:
    """Seconds from sending to the headers and to the first event, the events, the session."""
    headers = RESUMABLE if resumable else {}
    with httpx.Client(base_url=url, timeout=60) as client:
        sent = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json=_body(), headers=headers) as r:
            assert r.status_code == 200
            at_headers = time.perf_counter() - sent
            session = r.headers["x-session-id"]
            events, at_first = [], 0.0
            for event in iter_events(r):
                at_first = at_first or time.perf_counter() - sent
                events.append(event)
    return at_headers, at_first, events, session


def _shape(chunk: dict[str, Any]) -> tuple[Any, ...]:
    """The keys and ids of a chunk (the first event also carries the stream's resume token)."""
    choice = chunk["choices"][0]
    keys = sorted(set(chunk) - {"resume_token"})
    return (keys, sorted(choice), chunk["id"], chunk["created"], chunk["model"])


@pytest.mark.parametrize("resumable", [False, True], ids=["openai-wire", "id-wire"])
def test_first_chunk_carries_the_first_token_and_comes_after_it(
    live_server: Any, resumable: bool
) -> None:
    server = live_server()
    at_headers, at_first, events, session = _timed_stream(server.url, resumable)
    chunks = [e.json for e in events if e.data != "[DONE]"]
    first, second = chunks[0], chunks[1]
    delta = first["choices"][0]["delta"]
    assert delta["role"] == "assistant" and set(delta) == {"role", "content"}
    # JSON-identical to any other token chunk, but for the role
    assert _shape(first) == _shape(second) and set(second["choices"][0]["delta"]) == {"content"}
    assert not any("role" in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    # the server saw its first token (arrival -> media, queue, vision, prefill) before the
    # client saw the first chunk; the headers went out before any of that work was done
    metrics = chunks[-1]["metrics"]
    to_token = sum(metrics[k] for k in ("media_ms", "queue_time_ms", "time_to_first_token_ms"))
    assert at_first * 1000 >= to_token
    assert metrics["prefill_ms"] > 0
    usage = chunks[-1]["usage"]  # the prompt was prefilled, not found in the prefix cache
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] / 10
    assert (at_first - at_headers) * 1000 >= metrics["prefill_ms"] / 2
    if resumable:
        assert [e.index for e in events] == list(range(len(events)))
    # the stored stream replays exactly what was sent, from index 0
    url = f"{server.url}/v1/streams/{session}"
    with httpx.stream("GET", url, headers=RESUMABLE, timeout=60) as r:
        replay = list(iter_events(r))
    assert [e.data for e in replay] == [without_token(e.data) for e in events]
    assert [e.index for e in replay] == list(range(len(replay)))


async def test_a_choice_that_ends_without_a_token_still_opens_with_the_role(
    make_client: Any,
) -> None:
    """A resumed stream whose tokens had all been sent: its choices owe nothing but the end."""
    client: httpx.AsyncClient = await make_client()
    body = {**_body(), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    assert '"role":"assistant"' in lines[0] and '"role"' not in "".join(lines[1:])
