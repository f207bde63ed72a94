"""``n`` > 1 through /v1/chat/completions: n choices, each with its index, finish reason and
stream events; usage counts the prompt once and sums the choices' completion tokens; with a
seed, choice i equals a single request with seed + i; n over VLMSERVE_MAX_N is a 400."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import httpx
import openai

from support import MODEL


def chat(**kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a story"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 40,
        "ignore_eos": True,
        **kw,
    }


async def text_of(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def test_n_3_returns_3_choices_equal_to_single_requests_with_seed_plus_i(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(max_n=8)
    r = await client.post("/v1/chat/completions", json=chat(n=3))
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    single = [await text_of(client, chat(seed=40 + i)) for i in range(3)]
    assert [c["message"]["content"] for c in data["choices"]] == single
    one = (await client.post("/v1/chat/completions", json=chat())).json()["usage"]
    assert data["usage"]["prompt_tokens"] == one["prompt_tokens"]  # counted once
    assert data["usage"]["completion_tokens"] == 30
    assert data["usage"]["total_tokens"] == one["prompt_tokens"] + 30


async def test_the_stream_carries_each_choice_under_its_index(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(max_n=8)
    body = chat(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    roles: list[int] = []
    logprobs: dict[int, int] = defaultdict(int)
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                if c["delta"].get("role"):
                    roles.append(c["index"])
                texts[c["index"]] += c["delta"].get("content") or ""
                logprobs[c["index"]] += len((c["logprobs"] or {}).get("content") or [])
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
    assert roles == [0, 1] and finishes == {0: "length", 1: "length"}
    assert dict(logprobs) == {0: 10, 1: 10}
    assert [texts[0], texts[1]] == [await text_of(client, chat(seed=40 + i)) for i in range(2)]
    assert usage is not None and usage["completion_tokens"] == 20


async def test_the_openai_client_reads_n_choices(make_client: Callable[..., Any]) -> None:
    client = await make_client(max_n=8)
    sdk = openai.AsyncOpenAI(base_url="http://vlmserve.test/v1", api_key="x", http_client=client)
    body = chat(n=2)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    answer = await sdk.chat.completions.create(**body, extra_body=extra)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage is not None and answer.usage.completion_tokens == 20


async def test_n_over_the_limit_is_a_400_naming_the_setting(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(max_n=4)
    r = await client.post("/v1/chat/completions", json=chat(n=5))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "VLMSERVE_MAX_N" in error["message"]
