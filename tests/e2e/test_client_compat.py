"""Real clients of the field against a real ``vlmserve serve`` process (tiny model, loopback).

LiteLLM's ``hosted_vllm/`` and ``openai/`` providers and the openai SDK stream on the default
(OpenAI) wire; vlmserve's own load-test client reads both wires; a browser's EventSource,
reconnecting after a finished stream with the id of its last event, gets 204 and stops.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from sse_client import RESUMABLE, read_events
from support import ServerProcess
from vlmserve.client.stream import stream_chat

pytestmark = [
    pytest.mark.slow,
    # pydantic warns about litellm's own types on import; nothing to do with this server
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for the cost map
    return pytest.importorskip("litellm")


def greedy(url: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _carries_something(chunk: Any) -> bool:
    if getattr(chunk, "usage", None):
        return True
    choice = chunk.choices[0] if chunk.choices else None
    return choice is not None and bool(
        choice.finish_reason or choice.delta.role or choice.delta.content
    )


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_stream_parses_with_the_servers_text_and_usage(
    server: ServerProcess, litellm: Any, provider: str
) -> None:
    expected = greedy(server.url, 12)
    chunks = list(
        litellm.completion(
            model=f"{provider}/tiny",
            api_base=f"{server.url}/v1",
            api_key="none",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].id.startswith("chatcmpl-") and all(c.id == chunks[0].id for c in chunks)
    assert all(_carries_something(c) for c in chunks)  # no empty chunk made of an `id:` line
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["choices"][0]["message"]["content"]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].prompt_tokens == expected["usage"]["prompt_tokens"]
    assert usage[-1].completion_tokens == expected["usage"]["completion_tokens"]
    assert usage[-1].total_tokens == expected["usage"]["total_tokens"]


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_json_answer_and_logit_bias_reach_the_server(
    server: ServerProcess, litellm: Any, provider: str
) -> None:
    expected = greedy(server.url, 12)
    common = {"api_base": f"{server.url}/v1", "api_key": "none", "messages": MESSAGES}
    answer = litellm.completion(model=f"{provider}/tiny", max_tokens=12, temperature=0, **common)
    assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert answer.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    # a field the answer depends on is passed through, not dropped on the way
    biased = litellm.completion(
        model=f"{provider}/tiny", max_tokens=4, temperature=0, logit_bias={"100": 100}, **common
    )
    forced = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 4,
            "temperature": 0,
            "logit_bias": {"100": 100},
        },
        timeout=60,
    ).json()
    assert biased.choices[0].message.content == forced["choices"][0]["message"]["content"]
    unbiased = greedy(server.url, 4)["choices"][0]["message"]["content"]
    assert forced["choices"][0]["message"]["content"] != unbiased


def test_openai_sdk_stream_has_the_servers_text_and_usage(server: ServerProcess) -> None:
    openai = pytest.importorskip("openai")
    expected = greedy(server.url, 12)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["choices"][0]["message"]["content"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        expected["usage"]["prompt_tokens"],
        expected["usage"]["completion_tokens"],
        expected["usage"]["total_tokens"],
    )


async def test_load_client_reads_both_wires(server: ServerProcess) -> None:
    options = {"include_usage": True}
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": options,
    }
    records = []
    for headers in ({}, RESUMABLE):
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
            records.append(await stream_chat(c, body))
    for record in records:
        assert record.ok, record.message
        assert record.usage_seen and record.output_tokens == 8 and record.prompt_tokens > 0
        assert len(record.itl) == 7  # one gap between each two of the 8 token events


def test_eventsource_reconnecting_after_the_end_gets_204(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        events, response = read_events(c, "POST", "/v1/chat/completions", json=body)
        sid = response.headers["x-session-id"]
        assert events[-1].data == "[DONE]"
        again = c.get(f"/v1/streams/{sid}", headers={**RESUMABLE, "Last-Event-ID": events[-1].id})
    assert again.status_code == 204 and again.content == b""


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers any POST with a two-event OpenAI stream and records the request headers."""

    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.rfile.read(int(self.headers["Content-Length"]))
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        }
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


def test_openai_sdk_and_litellm_do_not_ask_for_the_resumable_wire(litellm: Any) -> None:
    """Their streaming calls send ``Accept: application/json`` (openai) and ``*/*`` (LiteLLM,
    through httpx): neither names ``text/event-stream``, so both get the OpenAI wire."""
    openai = pytest.importorskip("openai")
    _Recorder.seen = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key="none")
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
        list(
            litellm.completion(
                model="hosted_vllm/m", api_base=base, api_key="none", messages=MESSAGES, stream=True
            )
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    accepts = [h.get("accept") for h in _Recorder.seen]
    assert accepts == ["application/json", "*/*"], accepts


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_server() -> Iterator[ServerProcess]:
    """A real server on a scripted checkpoint whose greedy answer is one hermes tool call."""
    from vlmserve.testing.scripted import TOOLS_CHAT_TEMPLATE, build_scripted

    model = build_scripted(CALL, template=TOOLS_CHAT_TEMPLATE)
    process = ServerProcess(
        ["serve", "--model", str(model), "--served-model-name", "tiny", "--device", "cpu"]
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_langchain_bind_tools_gets_the_tool_call_back(tools_server: ServerProcess) -> None:
    """LangChain's ``ChatOpenAI(...).bind_tools([...])``, invoked and streamed: the answer is
    an AIMessage whose ``tool_calls`` name the function with parsed arguments."""
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: str) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    llm = langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=f"{tools_server.url}/v1",
        api_key="x",
        temperature=0,
        max_tokens=60,
    )
    bound = llm.bind_tools([get_weather])
    message = bound.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    merged = None
    for piece in bound.stream("What is the weather in Paris?"):
        merged = piece if merged is None else merged + piece
    assert merged is not None
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
