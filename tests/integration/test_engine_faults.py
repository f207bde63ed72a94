"""Engine faults seen through the API (in-process app, tiny Qwen2-VL, one method made to raise).

Pinned: a fatal engine error ends every request of the model (running, waiting, streaming)
within a second with an error in the OpenAI shape, ``/health`` and ``/admin/state`` show it,
and the model is reloaded and serves again; a poison request fails alone while its
companions finish; a request out of memory is a 503 ``out_of_memory`` to retry, the engine
lives; degenerate sampling values are a 200 or a 4xx, never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.registry.manager import ModelManager

ADMIN = {"Authorization": "Bearer admin-secret"}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    return {**body, **extra}


@pytest.fixture
async def app_client(tiny_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ModelManager]]:
    """An app with its own model (a fault must not break the session's shared one)."""
    settings = make_settings(tiny_dir, max_num_seqs=4, admin_keys=["admin-secret"])
    models = ModelManager.from_settings(settings)
    models.policy.reload_backoff = 0.5  # the failed state stays visible at least this long
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            yield c, models
    models.close()


def backend_of(models: ModelManager) -> HFChatBackend:
    backend = models.resolve(MODEL).backend
    assert isinstance(backend, HFChatBackend) and backend.engine is not None
    return backend


async def until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    """The data payloads of one streamed completion, [DONE] included."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


async def test_an_engine_loop_error_ends_every_request_within_a_second_and_the_model_reloads(
    app_client: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    client, models = app_client
    backend = backend_of(models)
    engine = backend.engine
    assert engine is not None
    long = {"max_tokens": 400}
    jsons = [
        asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"q{i}", **long)))
        for i in range(4)
    ]
    streams = [asyncio.create_task(stream_events(client, chat(f"s{i}", **long))) for i in range(4)]
    await until(
        lambda: engine.gauges.running == 4 and engine.gauges.queued == 4 and engine.steps > 3
    )

    def boom() -> None:
        raise RuntimeError("injected engine fault")

    engine.step = boom  # type: ignore[method-assign]  # the next step raises in the loop
    injected = time.monotonic()
    done = await asyncio.wait_for(asyncio.gather(*jsons, *streams), timeout=5)
    elapsed = time.monotonic() - injected
    assert elapsed < 1.0, f"the requests took {elapsed:.2f} s to end"

    for r in done[:4]:
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_failed" and error["type"] == "service_unavailable"
        assert "reloaded" in error["message"]
        assert r.headers["Retry-After"]
    for events in done[4:]:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]  # a final error event, then [DONE]
        assert error["code"] == "engine_failed", error  # says to retry, like the JSON 503

    health = (await client.get("/health")).json()
    assert "engine failed: RuntimeError: injected engine fault" in health["error"]
    assert health["models"] == [{"id": MODEL, "state": "failed"}]
    state = (await client.get("/admin/state", headers=ADMIN)).json()["models"][0]
    assert state["state"] == "failed" and state["engine_failures"] == 1
    refused = await client.post("/v1/chat/completions", json=chat("while failed"))
    assert refused.status_code == 503 and refused.headers["Retry-After"]

    await until(lambda: backend.state.value == "ready")  # reloaded by the model manager
    assert backend.engine is not engine
    again = await client.post("/v1/chat/completions", json=chat("after the reload"))
    assert again.status_code == 200, again.text
    health = (await client.get("/health")).json()
    assert health["error"] is None and health["modelReady"] is True
    state = (await client.get("/admin/state", headers=ADMIN)).json()["models"][0]
    assert state["last_engine_error"] == "RuntimeError: injected engine fault"


async def test_a_poison_request_fails_alone_while_the_others_finish(
    app_client: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    client, models = app_client
    backend = backend_of(models)
    engine = backend.engine
    assert engine is not None
    # long enough to outlive the poison rows: two poison rows decoding with no companion
    # would be a batch whose every row fails alone, which is the engine's failure
    bodies = [chat(f"companion {i}", max_tokens=160 + i) for i in range(3)]
    alone = [(await client.post("/v1/chat/completions", json=b)).json() for b in bodies]
    decode = engine._decode_forward

    def poisoned(rows: list[Any]) -> list[int]:  # every step with the poison row in it fails
        if any("POISON" in str(s.prepared.request.messages) for s in rows):
            raise RuntimeError("this request breaks every forward it is in")
        return decode(rows)

    engine._decode_forward = poisoned  # type: ignore[method-assign]
    running = asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    for _ in range(2000):  # the companions decode before the poison rows arrive
        if engine.gauges.running >= 3:
            break
        await asyncio.sleep(0.005)
    poison = asyncio.create_task(client.post("/v1/chat/completions", json=chat("POISON")))
    poison_stream = asyncio.create_task(stream_events(client, chat("POISON stream")))
    companions = await running
    failed = await poison
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "generation_failed" and error["type"] == "internal_error"
    assert "other requests were not affected" in error["message"]  # details: the log only
    events = await poison_stream
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    for r, expected in zip(companions, alone, strict=True):
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
        assert got == expected["choices"][0]["message"]["content"]
    assert backend.state.value == "ready" and backend.engine is engine  # no reload
    assert backend.engine_failures == 0


async def test_a_request_out_of_memory_is_a_503_to_retry_and_the_engine_lives(
    app_client: tuple[httpx.AsyncClient, ModelManager],
) -> None:
    client, models = app_client
    backend = backend_of(models)
    engine = backend.engine
    assert engine is not None
    prefill = engine._prefill_forward

    def short(items: list[Any]) -> list[int]:  # a prompt too big for the memory left
        seqs = [item[0] if isinstance(item, tuple) else item for item in items]
        if any("HUGE" in str(s.prepared.request.messages) for s in seqs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return prefill(items)

    engine._prefill_forward = short  # type: ignore[method-assign]
    failed, events, fine = await asyncio.gather(
        client.post("/v1/chat/completions", json=chat("HUGE")),
        stream_events(client, chat("HUGE stream")),
        client.post("/v1/chat/completions", json=chat("a normal one")),
    )
    assert failed.status_code == 503, failed.text
    assert failed.headers["Retry-After"]
    error = failed.json()["error"]
    assert error["code"] == "out_of_memory" and error["type"] == "service_unavailable"
    assert "other requests were not affected" in error["message"]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "out_of_memory"
    assert fine.status_code == 200, fine.text
    assert backend.state.value == "ready" and backend.engine is engine
    assert backend.engine_failures == 0


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": 5e-324},
        {"temperature": 1e-300},
        {"temperature": 1e-45},
        {"temperature": 1e-30},
        {"temperature": 1e-5},
        {"temperature": 2.0, "top_p": 5e-324},
        {"temperature": 2.0, "top_k": 1_000_000, "top_p": 1.0},
        {"temperature": 1.0, "top_k": -1},
        {"repetition_penalty": 5e-324, "temperature": 1.0},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 10.0, "temperature": 1e-300},
        {"temperature": 1.5, "seed": -(2**63)},
        {"temperature": 1.5, "seed": 2**63 - 1},
    ],
    ids=lambda v: ",".join(f"{k}={v[k]}" for k in v),
)
async def test_degenerate_sampling_values_answer_200_or_4xx_never_5xx(
    app_client: tuple[httpx.AsyncClient, ModelManager], values: dict[str, Any]
) -> None:
    client, models = app_client
    body = chat("Say something", max_tokens=12, **{k: v for k, v in values.items()})
    body.setdefault("temperature", 0)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert backend_of(models).engine_failures == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("temperature", -1e-300),
        ("top_p", 0.0),
        ("temperature", 1e308),
    ],
)
async def test_out_of_range_sampling_values_are_a_400_naming_the_field(
    app_client: tuple[httpx.AsyncClient, ModelManager], field: str, value: float
) -> None:
    client, _ = app_client
    r = await client.post("/v1/chat/completions", json=chat("x", **{field: value}))
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
