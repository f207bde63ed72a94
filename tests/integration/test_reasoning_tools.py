"""Thinking models and tool calls through the chat API, with the official ``openai`` client.

The checkpoints are scripted (``vlmserve.testing.scripted``): greedy decoding emits a chosen
text whatever the prompt, so the server's parsing is what is tested — JSON and stream alike.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, build_scripted

THINKING = "The quick brown</think> The answer is 42."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
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
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """``await serve(model_dir, **settings)`` -> an AsyncOpenAI client on that model."""
    stack: list[Any] = []

    async def start(model_dir: Path, **overrides: Any) -> openai.AsyncOpenAI:
        settings = make_settings(model_dir, **overrides)
        models = ModelManager.from_settings(settings)
        app = build_app(settings, models=models)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        await models.load_all()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60)
        stack.append((ctx, http, models))
        return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)

    yield start
    for ctx, http, models in reversed(stack):
        await http.aclose()
        await ctx.__aexit__(None, None, None)
        models.close()


async def streamed(client: openai.AsyncOpenAI, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    stream = await client.chat.completions.create(model="tiny", stream=True, **kw)
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta, choice = chunk.choices[0].delta, chunk.choices[0]
        out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
        out["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


async def test_reasoning_is_split_from_the_answer_in_json_and_stream(serve: Any) -> None:
    client = await serve(build_scripted(THINKING, template=THINKING_CHAT_TEMPLATE))
    kw = {"messages": ASK, "max_tokens": 40, "temperature": 0}
    answer = await client.chat.completions.create(model="tiny", **kw)
    message = answer.choices[0].message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] == "The quick brown"
    assert message["content"] == " The answer is 42."
    assert "<think>" not in message["content"] and "</think>" not in message["content"]
    stream = await streamed(client, **kw)
    assert (stream["reasoning"], stream["content"]) == ("The quick brown", " The answer is 42.")
    hidden = await client.chat.completions.create(
        model="tiny", extra_body={"include_reasoning": False}, **kw
    )
    assert "reasoning" not in hidden.choices[0].message.model_dump(exclude_none=True)
    assert hidden.choices[0].message.content == " The answer is 42."


async def test_chat_template_kwargs_reach_the_template(serve: Any) -> None:
    client = await serve(build_scripted(THINKING, template=THINKING_CHAT_TEMPLATE))
    kw = {"messages": ASK, "max_tokens": 4, "temperature": 0}
    thinking = await client.chat.completions.create(model="tiny", **kw)
    off = await client.chat.completions.create(
        model="tiny", extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw
    )
    assert off.usage.prompt_tokens > thinking.usage.prompt_tokens  # the empty think block


async def test_a_tool_call_is_parsed_in_json_and_stream_and_the_result_goes_back(
    serve: Any,
) -> None:
    client = await serve(build_scripted(CALL, template=TOOLS_CHAT_TEMPLATE))
    kw = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0}
    answer = await client.chat.completions.create(model="tiny", **kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = await streamed(client, **kw)
    assert stream["finish"] == "tool_calls"
    assert stream["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    follow = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    again = await client.chat.completions.create(
        model="tiny", messages=follow, tools=TOOLS, max_tokens=60, temperature=0
    )
    assert again.usage.prompt_tokens > answer.usage.prompt_tokens  # the result is in the prompt


async def test_tool_choice_required_always_yields_a_call(serve: Any, tiny_dir: Path) -> None:
    client = await serve(tiny_dir)  # random weights: only the grammar makes it a call
    calls = 0
    for seed in range(3):
        answer = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        choice = answer.choices[0]
        if choice.finish_reason == "length":
            continue  # cut off mid-JSON by max_tokens: no call to read
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)
        calls += 1
    assert calls >= 1  # not every answer may be cut off by max_tokens


async def test_bad_tool_requests_are_clear_4xx(serve: Any, tiny_dir: Path) -> None:
    client = await serve(tiny_dir)
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        await client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_call_cut_by_max_tokens_comes_back_as_content(
    serve: Any, tiny_dir: Path, choice: Any
) -> None:
    client = await serve(tiny_dir)  # the grammar makes it JSON; 6 tokens cannot close a call
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0}
    answer = await client.chat.completions.create(model="tiny", max_tokens=6, **kw)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "length"
    assert message.tool_calls is None
    assert message.content and message.content.lstrip().startswith(("{", "["))
    assert answer.usage.completion_tokens == 6
    stream = await streamed(client, max_tokens=6, **kw)
    assert stream == {"reasoning": "", "content": message.content, "calls": {}, "finish": "length"}


async def test_a_parsed_call_cut_by_max_tokens_comes_back_as_content(serve: Any) -> None:
    client = await serve(build_scripted(CALL, template=TOOLS_CHAT_TEMPLATE))
    kw = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 8}
    answer = await client.chat.completions.create(model="tiny", **kw)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "length" and message.tool_calls is None
    assert message.content and CALL.startswith(message.content)
    stream = await streamed(client, **kw)
    assert stream == {"reasoning": "", "content": message.content, "calls": {}, "finish": "length"}
