"""``response_format`` on a thinking model: the grammar constrains only the answer after
``</think>``; the reasoning before it is free text (the template opens ``<think>`` in the
prompt). Scripted checkpoints (``vlmserve.testing.scripted``) make greedy output known, so a
grammar applied too early would visibly destroy the reasoning."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, build_scripted

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [42]}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "What is six times seven?"}]


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    """``await serve(model_dir)`` -> an httpx client on the app serving that model."""
    stack: list[Any] = []

    async def start(model_dir: Path) -> httpx.AsyncClient:
        settings = make_settings(model_dir)
        models = ModelManager.from_settings(settings)
        app = build_app(settings, models=models)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        await models.load_all()
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        )
        stack.append((ctx, http, models))
        return http

    yield start
    for ctx, http, models in reversed(stack):
        await http.aclose()
        await ctx.__aexit__(None, None, None)
        models.close()


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 40,
        "temperature": 0,
        "response_format": FORMAT,
        **kw,
    }


async def streamed(client: httpx.AsyncClient, **kw: Any) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    async with client.stream("POST", "/v1/chat/completions", json=body(stream=True, **kw)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning") or ""
                content += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return reasoning, content, finish


@pytest.mark.parametrize("answer", ['{"answer":42}', " The answer is 42."])
async def test_the_grammar_starts_after_the_reasoning_in_json_and_stream(
    serve: Any, answer: str
) -> None:
    """The model reasons freely, then answers; its own answer is JSON (it passes the
    grammar untouched) or prose (the grammar turns it into the schema's JSON)."""
    client = await serve(
        build_scripted("The quick brown</think>" + answer, template=THINKING_CHAT_TEMPLATE)
    )
    r = await client.post("/v1/chat/completions", json=body())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning"] == "The quick brown"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    reasoning, content, finish = await streamed(client)
    assert reasoning == "The quick brown"
    assert json.loads(content) == {"answer": 42} and finish == "stop"


async def test_with_thinking_disabled_the_grammar_applies_from_the_first_token(
    serve: Any,
) -> None:
    client = await serve(
        build_scripted('The quick brown</think>{"answer":42}', template=THINKING_CHAT_TEMPLATE)
    )
    r = await client.post(
        "/v1/chat/completions", json=body(chat_template_kwargs={"enable_thinking": False})
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert not message.get("reasoning")
    assert json.loads(message["content"]) == {"answer": 42}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


async def test_a_named_tool_choice_lets_the_model_reason_before_its_call(serve: Any) -> None:
    """tool_choice names a function: its grammar (bare JSON call) starts after ``</think>``
    too, and the call is read from the answer, not from the reasoning."""
    call = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    client = await serve(
        build_scripted("The quick brown</think>" + call, template=THINKING_CHAT_TEMPLATE)
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": ASK,
            "max_tokens": 60,
            "temperature": 0,
            "tools": TOOLS,
            "tool_choice": named,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning"] == "The quick brown"
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("cut", ["The quick", 'The quick brown</think>{"ans'])
async def test_a_resumed_generation_replays_only_the_answer_into_the_grammar(cut: str) -> None:
    """Continuing after tokens already sent (a stream resumed after a restart): a prefix
    that is still reasoning starts no grammar; one past ``</think>`` replays only the part
    after it, so the JSON completes exactly as in the uninterrupted run."""
    from vlmserve.engine.hf.chat import HFChatBackend
    from vlmserve.engine.hf.loading import LoadOptions
    from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart

    script = 'The quick brown</think>{"answer":42}'
    model = build_scripted(script, template=THINKING_CHAT_TEMPLATE)
    backend = HFChatBackend(
        "tiny", LoadOptions(source=str(model), device="cpu", dtype="float32"), max_model_len=4096
    )
    backend.load()
    try:
        tokenizer = backend._require().processor.tokenizer
        req = GenerateRequest(
            "r",
            [ChatMessage("user", [TextPart(ASK[0]["content"])])],
            SamplingParams(max_tokens=40, temperature=0),
            response_format=FORMAT,
        )
        req.prefix_token_ids = tokenizer.encode(cut, add_special_tokens=False)
        text = ""
        async for chunk in backend.generate(await backend.prepare(req)):
            text += chunk.reasoning + chunk.text
        assert cut.replace("</think>", "") + text == script.replace("</think>", "")
    finally:
        backend.close()
