"""Per-request timings in every answer that asks for them: vLLM's ``metrics`` object (and
media, vision, prefill on top) in a JSON answer, a stream's usage chunk and its stored replay,
a Responses object (returned and retrieved) and a batch's output lines; never for ``n`` > 1;
a ``Server-Timing`` header on every non-streamed chat answer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import MODEL

VLLM_FIELDS = {
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
}
OURS = {"media_ms", "vision_ms", "prefill_ms", "e2e_ms"}


def _chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 5, "ignore_eos": True, **extra}


def _check(metrics: dict[str, Any], tokens: int) -> None:
    assert set(metrics) == VLLM_FIELDS | OURS
    first = metrics["vision_ms"] + metrics["prefill_ms"]
    assert metrics["time_to_first_token_ms"] == pytest.approx(first, abs=0.01)
    decode = metrics["generation_time_ms"]
    assert metrics["mean_itl_ms"] * (tokens - 1) == pytest.approx(decode, abs=0.01)
    phases = ("media_ms", "queue_time_ms", "time_to_first_token_ms", "generation_time_ms")
    assert sum(metrics[k] for k in phases) <= metrics["e2e_ms"] + 0.01


async def test_a_json_answer_carries_its_metrics_when_asked_and_always_server_timing(
    make_client: Any,
) -> None:
    client: httpx.AsyncClient = await make_client()
    plain = await client.post("/v1/chat/completions", json=_chat())
    assert "metrics" not in plain.json() and "prefill;dur=" in plain.headers["server-timing"]
    asked = (await client.post("/v1/chat/completions", json=_chat(include_metrics=True))).json()
    _check(asked["metrics"], asked["usage"]["completion_tokens"])
    two = await client.post("/v1/chat/completions", json=_chat(include_metrics=True, n=2))
    assert "metrics" not in two.json()  # as vLLM: one generation's timings or none


async def test_the_server_switch_times_every_answer_unless_one_declines(make_client: Any) -> None:
    client: httpx.AsyncClient = await make_client(per_request_metrics=True)
    assert "metrics" in (await client.post("/v1/chat/completions", json=_chat())).json()
    off = await client.post("/v1/chat/completions", json=_chat(include_metrics=False))
    assert "metrics" not in off.json()


async def _events(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[dict], str]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        return [json.loads(line[6:]) for line in lines], r.headers["x-session-id"]


async def test_a_stream_carries_its_metrics_in_the_usage_chunk_and_its_stored_replay(
    make_client: Any,
) -> None:
    client: httpx.AsyncClient = await make_client()
    usage = {"include_usage": True}
    events, session = await _events(
        client, _chat(stream=True, stream_options=usage, include_metrics=True)
    )
    assert [e for e in events if "metrics" in e] == [events[-1]]
    _check(events[-1]["metrics"], events[-1]["usage"]["completion_tokens"])
    replay = (await client.get(f"/v1/streams/{session}")).text
    stored = [json.loads(line[6:]) for line in replay.splitlines() if line.startswith("data: {")]
    assert stored[-1]["metrics"] == events[-1]["metrics"]
    no_usage, _ = await _events(client, _chat(stream=True, include_metrics=True))
    assert not any("metrics" in e for e in no_usage)  # vLLM's: on the usage chunk only


async def test_a_response_object_carries_its_metrics_returned_and_retrieved(
    make_client: Any,
) -> None:
    client: httpx.AsyncClient = await make_client()
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "include_metrics": True}
    stored = (await client.post("/v1/responses", json=body)).json()
    assert set(stored["metrics"]) == VLLM_FIELDS | OURS
    again = (await client.get(f"/v1/responses/{stored['id']}")).json()
    assert again["metrics"] == stored["metrics"]
    unstored = (await client.post("/v1/responses", json={**body, "store": False})).json()
    assert set(unstored["metrics"]) == VLLM_FIELDS | OURS
    plain = (await client.post("/v1/responses", json={**body, "include_metrics": None})).json()
    assert "metrics" not in plain


async def test_batch_output_lines_carry_their_metrics(make_client: Any, tmp_path: Path) -> None:
    http: httpx.AsyncClient = await make_client(files_dir=str(tmp_path))
    api = openai.AsyncOpenAI(
        base_url="http://vlmserve.test/v1", api_key="x", http_client=http, max_retries=0
    )
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate([_chat(include_metrics=True), _chat()])
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    source = await api.files.create(file=("in.jsonl", data), purpose="batch")
    batch = await api.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for _ in range(600):
        batch = await api.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(0.05)
    assert batch.status == "completed" and batch.output_file_id is not None
    content = await api.files.content(batch.output_file_id)
    bodies = [json.loads(line)["response"]["body"] for line in content.text.splitlines()]
    assert set(bodies[0]["metrics"]) == VLLM_FIELDS | OURS and "metrics" not in bodies[1]
