"""``logprobs`` / ``top_logprobs`` through /v1/chat/completions, JSON and stream, in
OpenAI's shape (``choices[].logprobs.content[]``: token, logprob, bytes, top_logprobs); the
values themselves are checked against the model in tests/unit/engine/hf/test_logprobs.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from support import MODEL


def chat(**kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


async def stream_items(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    items: list[Any] = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    items += (choice["logprobs"] or {}).get("content") or []
    return items


async def test_json_and_stream_carry_one_item_per_token_with_the_top_5(
    client: httpx.AsyncClient,
) -> None:
    body = chat(logprobs=True, top_logprobs=5)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    items = r.json()["choices"][0]["logprobs"]["content"]
    assert len(items) == r.json()["usage"]["completion_tokens"] == 8
    for item in items:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        top = [t["logprob"] for t in item["top_logprobs"]]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert item["logprob"] == pytest.approx(top[0])  # greedy: the best token was taken
        assert item["logprob"] <= 0
    streamed = await stream_items(client, body)
    assert [i["token"] for i in streamed] == [i["token"] for i in items]
    assert [i["logprob"] for i in streamed] == pytest.approx([i["logprob"] for i in items])


async def test_the_openai_client_reads_the_logprobs(client: httpx.AsyncClient) -> None:
    sdk = openai.AsyncOpenAI(base_url="http://vlmserve.test/v1", api_key="x", http_client=client)
    body = chat(logprobs=True, top_logprobs=2)
    extra = {"ignore_eos": body.pop("ignore_eos")}  # vLLM's field: not an SDK argument
    answer = await sdk.chat.completions.create(**body, extra_body=extra)
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)


async def test_without_logprobs_the_field_is_null(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.json()["choices"][0]["logprobs"] is None
    assert await stream_items(client, chat()) == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
async def test_top_logprobs_over_20_or_without_logprobs_is_a_400(
    client: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_presence_and_frequency_penalties_are_accepted_and_change_the_answer(
    client: httpx.AsyncClient,
) -> None:
    base = chat(max_tokens=32)
    base["messages"][0]["content"] = "Hello"
    plain = await client.post("/v1/chat/completions", json=base)
    penalties = {"presence_penalty": 2, "frequency_penalty": 2}
    pushed = await client.post("/v1/chat/completions", json={**base, **penalties})
    assert plain.status_code == pushed.status_code == 200, pushed.text
    assert (
        pushed.json()["choices"][0]["message"]["content"]
        != (plain.json()["choices"][0]["message"]["content"])
    )
