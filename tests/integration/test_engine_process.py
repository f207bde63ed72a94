"""The chat model's engine in its own process (the default; ``engine_process``), through the API.

Pinned on the tiny Qwen2-VL with a real engine process (``python -m vlmserve.engine.proc``):
the answers are the in-process engine's (greedy text and image, a stream, n = 2 with a seed,
a JSON-schema grammar, stop strings, /tokenize and /detokenize); an input error is the same
400 before any stream; a cancelled stream stops in the engine; an engine process killed
mid-stream ends its streams with a 503 ``engine_failed`` and the model manager starts a new
one; unloading stops the process.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from support import MODEL, make_settings
from upstreams import serve_asgi
from vlmserve.api.app import build_app
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    TextPart,
)
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import image_bytes

ADMIN = {"Authorization": "Bearer admin-secret"}


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }


def asks() -> list[dict[str, Any]]:
    """Requests whose answers must not depend on where the engine runs."""
    url = "data:image/png;base64," + base64.b64encode(image_bytes(64, 48)).decode()
    image = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is shown?"},
    ]
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    return [
        chat("hello"),
        chat(image),
        chat("two", n=2, temperature=1.0, seed=7),
        chat(
            "json",
            max_tokens=40,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "card", "schema": schema},
            },
        ),
        chat("stop", stop=["e"], max_tokens=40),
    ]


Served = tuple[httpx.AsyncClient, ModelManager]


@asynccontextmanager
async def serving(tiny_dir: Path, **settings: Any) -> AsyncIterator[Served]:
    config = make_settings(tiny_dir, admin_keys=["admin-secret"], **settings)
    models = ModelManager.from_settings(config)
    models.policy.reload_backoff = 0.2
    for handle in models.handles:
        await handle.backend.aload()
    app = build_app(config, models=models)
    try:
        async with (
            serve_asgi(app) as url,  # a real socket: streams arrive as they are sent
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            yield client, models
    finally:
        await models.aclose()


def engine_pid(models: ModelManager) -> int:
    pid = models.resolve(MODEL).backend.describe()["engine_process"]["pid"]
    assert isinstance(pid, int) and pid != os.getpid()
    return pid


async def until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def answers(client: httpx.AsyncClient) -> list[Any]:
    out = []
    for body in asks():
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out.append([(c["message"], c["finish_reason"]) for c in r.json()["choices"]])
    streamed = {**chat("a stream", max_tokens=12), "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=streamed) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    text = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines)
    return [*out, text, *await tokenized(client)]


async def tokenized(client: httpx.AsyncClient) -> list[Any]:
    """/tokenize of an image chat and a prompt, /detokenize back, and an id it refuses."""
    image = asks()[1]["messages"]
    counted = (await client.post("/tokenize", json={"model": MODEL, "messages": image})).json()
    prompt = (await client.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})).json()
    back = await client.post("/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]})
    bad = await client.post("/detokenize", json={"model": MODEL, "tokens": [10**9]})
    usage = (await client.post("/v1/chat/completions", json=asks()[1])).json()["usage"]
    assert counted["count"] == usage["prompt_tokens"] and back.json() == {"prompt": "héllo"}
    return [counted, prompt, bad.status_code, bad.json()]


async def test_answers_and_input_errors_are_the_in_process_engines(tiny_dir: Path) -> None:
    long = chat("word " * 400, stream=True)  # over the context: a 400 before any stream
    async with serving(tiny_dir, max_model_len=256) as (client, _):
        local = await answers(client)
        local_error = await client.post("/v1/chat/completions", json=long)
    async with serving(tiny_dir, max_model_len=256, engine_process=True) as (client, models):
        assert engine_pid(models) in {p.pid for p in psutil.Process().children()}
        remote = await answers(client)
        remote_error = await client.post("/v1/chat/completions", json=long)
        metrics = (await client.get("/metrics")).text
    assert remote == local
    assert local_error.status_code == remote_error.status_code == 400
    assert remote_error.json() == local_error.json()
    assert f'vlmserve_num_requests_running{{model="{MODEL}"}}' in metrics
    rss = f'vlmserve_engine_process_resident_memory_bytes{{model="{MODEL}"}} '
    [line] = [x for x in metrics.splitlines() if x.startswith(rss)]
    assert float(line.split()[-1]) > 100 * 2**20  # torch and the model, in the engine process


async def test_a_cancelled_stream_stops_in_the_engine_process(tiny_dir: Path) -> None:
    async with serving(tiny_dir, engine_process=True) as (client, models):
        backend = models.resolve(MODEL).backend
        body = {**chat("on and on", max_tokens=20000, ignore_eos=True), "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            await until(lambda: backend.stats().running == 1, timeout=5)
            cancel = await client.post(f"/v1/cancel/{r.headers['x-session-id']}")
            assert cancel.json()["cancelled"] is True
            rest = [json.loads(x[6:]) async for x in lines if x.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "cancelled"
        # the engine process dropped it (its 20,000 tokens would take most of a minute)
        await until(lambda: backend.stats().running == 0, timeout=5)
        after = await client.post("/v1/chat/completions", json=chat("still there?"))
    assert after.status_code == 200


def ask(text: str, max_tokens: int, **sampling: Any) -> GenerateRequest:
    message = ChatMessage(role="user", content=[TextPart(text=text)])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return GenerateRequest(request_id=text, messages=[message], sampling=params)


async def generated(backend: Any, prepared: Any) -> tuple[list[int], str | None]:
    chunks = [chunk async for chunk in backend.generate(prepared)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


async def test_a_prepared_request_starts_before_its_chunks_are_asked_for(tiny_dir: Path) -> None:
    """The engine process starts a request once it is prepared: the chunks it makes before
    the API process asks for them are held, none lost; a prepared request discarded instead
    stops there."""
    async with serving(tiny_dir, engine_process=True) as (client, models):
        backend = models.resolve(MODEL).backend
        at_once = await generated(backend, await backend.prepare(ask("held", 12)))
        queried = backend.stats().prefix_cache[0]
        prepared = await backend.prepare(ask("held", 12))
        # admitted (its prompt queried against the prefix cache) with nobody reading yet
        await until(lambda: backend.stats().prefix_cache[0] > queried, timeout=10)
        await asyncio.sleep(0.2)  # its 12 tokens are made by now, and held
        assert await generated(backend, prepared) == at_once
        assert len(at_once[0]) == 12 and at_once[1] == "length"

        endless = await backend.prepare(ask("on and on", 20000, ignore_eos=True))
        await until(lambda: backend.stats().running == 1, timeout=10)  # running, unasked
        await backend.discard(endless)
        await until(lambda: backend.stats().running == 0, timeout=10)
        after = await client.post("/v1/chat/completions", json=chat("still there?"))
    assert after.status_code == 200


async def test_a_killed_engine_process_is_replaced_and_unloading_stops_it(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vlmserve.engine.proc.client")
    async with serving(tiny_dir, engine_process=True) as (client, models):
        backend = models.resolve(MODEL).backend
        first = engine_pid(models)
        body = {**chat("on and on", max_tokens=5000, ignore_eos=True), "stream": True}
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and not events:
                    os.kill(first, signal.SIGKILL)
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_failed" and "exit code -9" in error["message"]
        client_log = [r for r in caplog.records if r.name == "vlmserve.engine.proc.client"]
        crash = [r for r in client_log if "exit code -9" in r.getMessage()]
        assert [r.levelno for r in crash] == [logging.ERROR]  # a crash is an error
        state = (await client.get("/admin/state", headers=ADMIN)).json()["models"][0]
        assert state["engine_failures"] == 1
        await until(lambda: backend.state.value == "ready")  # reloaded: a new process
        assert engine_pid(models) != first
        again = await client.post("/v1/chat/completions", json=chat("after the reload"))
        assert again.status_code == 200, again.text
        assert backend.stats().last_engine_error == "its engine process exited (exit code -9)"
        second = engine_pid(models)
        r = await client.post("/admin/deactivate", headers=ADMIN, json={"model": MODEL})
        assert r.status_code == 200, r.text
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"


async def test_a_load_failure_in_the_engine_process_is_the_models_error(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "nothing-here", engine_process=True)
    models = ModelManager.from_settings(settings)
    backend = models.handles[0].backend
    with pytest.raises(Exception, match="nothing-here"):
        await backend.aload()
    assert backend.state.value == "failed" and "nothing-here" in (backend.error or "")
    await models.aclose()
