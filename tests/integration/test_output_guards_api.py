"""The output guards through the chat API with the official ``openai`` client: a looping
scripted checkpoint stops with vLLM's finish reason ``repetition`` (JSON and stream), a
scripted thinking checkpoint with ``thinking_token_budget: 8`` closes its reasoning after
8 tokens and answers, ``allowed_token_ids`` restricts the answer, bad values are 400s."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, build_scripted

LOOP = " Total: 12.50 EUR"  # 14 distinct tokens, emitted over and over
REASONING = " Let me count the legs of each cat and then add them up carefully"
ANSWER = "\n\nTwelve legs."
ASK = [{"role": "user", "content": "Read the receipt."}]
DETECT = {"max_pattern_size": 20, "min_pattern_size": 2, "min_count": 3}


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """``await serve(model_dir, **settings)`` -> (AsyncOpenAI client, httpx client) on that
    model."""
    stack: list[Any] = []

    async def start(
        model_dir: Path, **overrides: Any
    ) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
        settings = make_settings(model_dir, **overrides)
        models = ModelManager.from_settings(settings)
        app = build_app(settings, models=models)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        await models.load_all()
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        )
        stack.append((ctx, http, models))
        return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http), http

    yield start
    for ctx, http, models in reversed(stack):
        await http.aclose()
        await ctx.__aexit__(None, None, None)
        models.close()


async def streamed(client: openai.AsyncOpenAI, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "content": "", "finish": None}
    stream = await client.chat.completions.create(model="tiny", stream=True, **kw)
    async for chunk in stream:
        for choice in chunk.choices:
            out["reasoning"] += (choice.delta.model_extra or {}).get("reasoning") or ""
            out["content"] += choice.delta.content or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_a_looping_model_stops_at_the_repetition_with_vllms_finish_reason(
    serve: Any, engine_process: bool
) -> None:
    client, _ = await serve(build_scripted(LOOP, loop=True), engine_process=engine_process)
    kw: dict[str, Any] = {"messages": ASK, "max_tokens": 80, "temperature": 0}
    free = await client.chat.completions.create(model="tiny", **kw)
    assert free.choices[0].finish_reason == "length"
    assert free.choices[0].message.content.startswith(LOOP * 5)
    guarded = await client.chat.completions.create(
        model="tiny", extra_body={"repetition_detection": DETECT}, **kw
    )
    assert guarded.choices[0].finish_reason == "repetition"
    assert guarded.choices[0].message.content == LOOP * 3
    assert guarded.usage is not None and guarded.usage.completion_tokens == 42
    stream = await streamed(client, extra_body={"repetition_detection": DETECT}, **kw)
    assert (stream["content"], stream["finish"]) == (LOOP * 3, "repetition")
    off = {"max_pattern_size": 0}  # vLLM's way to turn it off
    unguarded = await client.chat.completions.create(
        model="tiny", extra_body={"repetition_detection": off}, **kw
    )
    assert unguarded.choices[0].finish_reason == "length"


async def test_a_thinking_budget_of_8_closes_the_reasoning_and_the_model_answers(
    serve: Any,
) -> None:
    model = build_scripted(REASONING + "</think>" + ANSWER, template=THINKING_CHAT_TEMPLATE)
    client, _ = await serve(model)
    kw: dict[str, Any] = {"messages": ASK, "max_tokens": 60, "temperature": 0}
    free = await client.chat.completions.create(model="tiny", **kw)
    assert (free.choices[0].message.model_extra or {})["reasoning"] == REASONING
    budget = {"thinking_token_budget": 8}
    answer = await client.chat.completions.create(model="tiny", extra_body=budget, **kw)
    message = answer.choices[0].message
    tokenizer = AutoTokenizer.from_pretrained(model)
    first8 = tokenizer.decode(tokenizer.encode(REASONING, add_special_tokens=False)[:8])
    reasoning = (message.model_extra or {})["reasoning"]
    assert (reasoning, message.content) == (first8, ANSWER)
    assert answer.choices[0].finish_reason == "stop"
    stream = await streamed(client, extra_body=budget, **kw)
    assert (stream["reasoning"], stream["content"]) == (reasoning, ANSWER)
    unlimited = await client.chat.completions.create(
        model="tiny", extra_body={"thinking_token_budget": -1}, **kw
    )
    assert (unlimited.choices[0].message.model_extra or {})["reasoning"] == REASONING


async def test_allowed_token_ids_restrict_the_answer(serve: Any, tiny_dir: Path) -> None:
    client, _ = await serve(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    allowed = tokenizer.encode(" Hi", add_special_tokens=False)
    kw: dict[str, Any] = {"messages": ASK, "max_tokens": 6, "temperature": 0}
    free = await client.chat.completions.create(model="tiny", **kw)
    answer = await client.chat.completions.create(
        model="tiny", extra_body={"allowed_token_ids": allowed}, **kw
    )
    text = answer.choices[0].message.content or ""
    assert text != free.choices[0].message.content
    assert len(text) >= 6 and set(text) <= set(" Hi")  # only " H" and "i" tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", [10**7]),
        ("thinking_token_budget", -2),
        ("thinking_token_budget", 8.5),
        ("thinking_token_budget", True),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 1}),
        ("repetition_detection", {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}),
        ("repetition_detection", {"max_pattern_size": 4096, "min_count": 2}),
        ("repetition_detection", {"window": 8}),
    ],
)
async def test_invalid_guard_values_are_400s_naming_the_field(
    serve: Any, tiny_dir: Path, field: str, value: Any
) -> None:
    _, http = await serve(tiny_dir)
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, field: value}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(field) and error["type"] == "invalid_request_error"
