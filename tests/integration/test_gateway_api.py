"""A gateway in process, proxying to a vlmserve worker served by uvicorn in the same loop."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import MODEL, make_settings
from upstreams import fake_upstreams, serve_asgi
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelHandle, ModelManager
from vlmserve.testing import build_lora_adapter
from vlmserve.testing.media import image_bytes

ADMIN = {"Authorization": "Bearer adm"}
EMBED = "tiny-embed"


@pytest.fixture(scope="module")
def worker_models(tiny_dir: Path, chat_models: ModelManager) -> Iterator[ModelManager]:
    cfg = ModelConfig(
        name=EMBED,
        source=str(tiny_dir),
        adapter=str(build_lora_adapter(tiny_dir)),
        roles=["embedding"],
    )
    embedder = hf_handle(cfg, Settings(device="cpu"))
    embedder.backend.load()
    yield ModelManager([*chat_models.handles, embedder])
    embedder.backend.close()


def upstream(name: str, urls: list[str], **kw: Any) -> ModelHandle:
    config = UpstreamConfig(
        model=kw.pop("model", MODEL),
        base_urls=urls,
        health_interval=0,
        policy=PoolPolicy(max_failures=1),
        **kw,
    )
    return ModelHandle(
        name, ["embedding"] if config.embedding else ["chat"], UpstreamBackend(name, config)
    )


@pytest.fixture
async def worker_url(tiny_dir: Path, worker_models: ModelManager) -> AsyncIterator[str]:
    """A vlmserve worker (in process, on a real port) holding the tiny chat and embedding
    models."""
    worker = build_app(make_settings(tiny_dir, max_model_len=200), models=worker_models)
    async with serve_asgi(worker) as url:
        yield url


@pytest.fixture
async def worker_client(worker_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=worker_url, timeout=60) as client:
        yield client


@pytest.fixture
async def gateway(worker_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with contextlib.AsyncExitStack() as stack:
        bad = await stack.enter_async_context(fake_upstreams(alive_but_broken, "http://bad"))
        models = ModelManager(
            [
                upstream("gw-tiny", [worker_url]),
                upstream("gw-embed", [worker_url], model=EMBED, embedding=True),
                upstream("gw-empty", []),
                upstream("gw-bad", bad.real("http://bad")),
            ]
        )
        app = build_app(Settings(device="cpu", admin_keys=["adm"]), models=models)
        await stack.enter_async_context(app.router.lifespan_context(app))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60
        )
        yield await stack.enter_async_context(client)
        await models.aclose()


def alive_but_broken(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200, json={"ok": True})
    return httpx.Response(500, json={"error": {"message": "engine dead", "type": "internal_error"}})


def chat(model: str = "gw-tiny", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0,
        **extra,
    }


async def test_chat_completion_is_proxied_with_upstream_usage(gateway: httpx.AsyncClient) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "gw-tiny"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 0
    assert body["choices"][0]["finish_reason"] == "length"


async def test_stream_through_gateway_has_its_own_session_ids(gateway: httpx.AsyncClient) -> None:
    body = chat(
        stream=True, session_id="gw-s1", stream_options={"include_usage": True, "resumable": True}
    )
    r = await gateway.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    ids = [line[4:] for line in r.text.splitlines() if line.startswith("id: ")]
    assert ids[0] == "gw-s1:0" and [int(i.rsplit(":", 1)[1]) for i in ids] == list(range(len(ids)))
    assert "data: [DONE]" in r.text
    last = json.loads(r.text.split("data: ")[-2].split("\n")[0])
    assert last["usage"]["completion_tokens"] == 5


async def test_upstream_4xx_reaches_the_client_with_its_status(gateway: httpx.AsyncClient) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat(max_tokens=250, stream=True))
    assert r.status_code == 400  # the worker's context limit (200), not the gateway's
    assert r.json()["error"]["param"] == "max_tokens"
    assert "context limit of 200 tokens" in r.json()["error"]["message"]


async def test_no_replica_is_503_with_retry_after(gateway: httpx.AsyncClient) -> None:
    r = await gateway.post("/v1/chat/completions", json=chat("gw-empty"))
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert "register" in r.json()["error"]["message"]


async def test_worker_endpoints_and_embeddings_are_proxied(gateway: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "gw-tiny", "max_new_tokens": 3, "messages": messages}
    r = await gateway.post("/generate", json=body)
    assert r.status_code == 200 and isinstance(r.json()["text"], str)
    r = await gateway.post("/encode-text", json={"text": "a cat", "model": "gw-embed"})
    assert r.status_code == 200 and len(r.json()["embedding"]) > 8
    r = await gateway.post("/v1/embeddings", json={"model": "gw-embed", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "gw-embed" and len(r.json()["data"]) == 2
    r = await gateway.post("/encode-text", json={"text": "", "model": "gw-embed"})
    assert r.status_code == 400


async def test_extraction_from_frames_is_answered_through_the_gateway_as_locally(
    gateway: httpx.AsyncClient, worker_client: httpx.AsyncClient
) -> None:
    """The task's chat request (frames as one ``input_video`` part) goes upstream as is: the
    worker decodes the frames and answers exactly what it answers when asked directly."""
    frames = [base64.b64encode(image_bytes(48, 48, "JPEG", seed=i)).decode() for i in range(3)]
    body = {"frames": frames, "text": "A clip.", "max_items": 2, "temperature": 0, "max_tokens": 64}
    direct = await worker_client.post("/v1/extract/entities", json={**body, "model": MODEL})
    proxied = await gateway.post("/v1/extract/entities", json={**body, "model": "gw-tiny"})
    assert direct.status_code == 200, direct.text
    assert proxied.status_code == 200, proxied.text
    assert proxied.json()["model"] == "gw-tiny"
    assert proxied.json()["entities"] == direct.json()["entities"]
    # the same prompt, frames included (the second finds the first's blocks in the prefix cache)
    details = "prompt_tokens_details"
    assert proxied.json()["usage"].keys() == direct.json()["usage"].keys()
    assert {k: v for k, v in proxied.json()["usage"].items() if k != details} == {
        k: v for k, v in direct.json()["usage"].items() if k != details
    }
    empty = await gateway.post("/v1/extract/entities", json={"frames": [], "model": "gw-tiny"})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "frames"


async def test_register_and_deregister_a_replica(
    gateway: httpx.AsyncClient, worker_url: str
) -> None:
    reg = {"model": "gw-empty", "url": worker_url, "instance": "w-1"}
    assert (await gateway.post("/v1/gateway/register", json=reg)).status_code == 401
    r = await gateway.post("/v1/gateway/register", json=reg, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["healthy"] is True
    assert (await gateway.post("/v1/chat/completions", json=chat("gw-empty"))).status_code == 200
    # the idle watchdog's body (HttpDeregisterHook) is accepted as is
    r = await gateway.post(
        "/v1/gateway/deregister", json={"instance": "w-1", "reason": "idle"}, headers=ADMIN
    )
    assert r.json()["deregistered"] == ["gw-empty"]
    assert (await gateway.post("/v1/chat/completions", json=chat("gw-empty"))).status_code == 503


async def test_register_refuses_non_upstream_models_and_bad_urls(
    gateway: httpx.AsyncClient, worker_url: str
) -> None:
    r = await gateway.post(
        "/v1/gateway/register",
        headers=ADMIN,
        json={"model": "nope", "url": worker_url, "instance": "x"},
    )
    assert r.status_code == 404
    body = {"model": "gw-empty", "url": "ftp://x", "instance": "x"}
    r = await gateway.post("/v1/gateway/register", headers=ADMIN, json=body)
    assert r.status_code == 400


async def test_replica_failing_preflight_is_out_with_the_reason(gateway: httpx.AsyncClient) -> None:
    bad = (await gateway.post("/admin/activate", json={"model": "gw-bad"}, headers=ADMIN)).json()
    assert bad["backend"] == "openai" and bad["state"] == "ready"
    replica = bad["upstream"]["replicas"][0]
    assert replica["healthy"] is False
    assert replica["reason"].startswith("preflight failed: models")
    r = await gateway.post("/v1/chat/completions", json=chat("gw-bad"))
    assert r.status_code == 503 and "preflight failed" in r.json()["error"]["message"]


async def test_worker_registration_client_adds_itself(
    gateway: httpx.AsyncClient, worker_url: str
) -> None:
    from vlmserve.gateway.registration_worker import Registration

    transport = gateway._transport  # the in-process gateway
    reg = Registration(
        "http://gw/v1/gateway/register",
        worker_url + "/",
        instance="w-9",
        api_key="adm",
        transport=transport,
        attempts=1,
    )
    assert await reg.register(["gw-empty"])
    assert (await gateway.post("/v1/chat/completions", json=chat("gw-empty"))).status_code == 200
    assert await reg.deregister()
    refused = Registration(
        "http://gw/v1/gateway/register",
        worker_url,
        instance="w-9",
        transport=transport,
        attempts=3,
        backoff=0,
    )
    assert not await refused.register(["gw-empty"])  # 401 without the admin key: no retry loop


async def test_control_routes_answer_403_on_a_gateway_started_with_no_keys() -> None:
    app = build_app(Settings(device="cpu"), models=ModelManager([]))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c,
    ):
        stranger = {"model": "gw-tiny", "url": "http://attacker.test:8000", "instance": "evil"}
        answers = [
            await c.post("/v1/gateway/register", json=stranger),
            await c.get("/v1/gateway/replicas"),
            await c.post("/v1/gateway/deregister", json={"instance": "w-1"}),
        ]
        for r in answers:
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["code"] == "admin_disabled" and "VLMSERVE_ADMIN_KEYS" in error["message"]
        assert (await c.get("/v1/models")).status_code == 200  # the API itself stays open


async def test_logit_bias_reaches_the_worker_as_sent(
    gateway: httpx.AsyncClient, worker_client: httpx.AsyncClient
) -> None:
    biased = chat(logit_bias={"100": 100}, ignore_eos=True)
    r = await gateway.post("/v1/chat/completions", json=biased)
    direct = await worker_client.post("/v1/chat/completions", json={**biased, "model": MODEL})
    plain = await gateway.post("/v1/chat/completions", json=chat(ignore_eos=True))
    text = r.json()["choices"][0]["message"]["content"]
    assert text == direct.json()["choices"][0]["message"]["content"]
    assert text != plain.json()["choices"][0]["message"]["content"]
    outside = await gateway.post("/v1/chat/completions", json=chat(logit_bias={"10000000": 5}))
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"


async def test_tokenize_and_detokenize_answer_upstream(
    gateway: httpx.AsyncClient, worker_client: httpx.AsyncClient
) -> None:
    messages = [{"role": "user", "content": "hello"}]
    r = await gateway.post("/tokenize", json={"model": "gw-tiny", "messages": messages})
    direct = await worker_client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    assert r.json() == direct.json()
    tokens = r.json()["tokens"]
    back = await gateway.post("/detokenize", json={"model": "gw-tiny", "tokens": tokens})
    assert back.json()["prompt"].endswith("hello<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("session", [None, "gw-first"], ids=["passed-through", "gateway-session"])
async def test_the_first_chunk_through_the_gateway_carries_the_first_token_and_the_role(
    gateway: httpx.AsyncClient, session: str | None
) -> None:
    """Passed through (the worker's bytes) or re-encoded by the gateway's own session."""
    body = chat(stream=True, max_tokens=3, ignore_eos=True)
    if session is not None:
        body["session_id"] = session  # a client's own name: the gateway's full path
    r = await gateway.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-session-id"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and "content" in deltas[0]
    assert not any("role" in d for d in deltas[1:])
    text = "".join(d.get("content") or "" for d in deltas)
    assert (
        text
        == (
            await gateway.post("/v1/chat/completions", json=chat(max_tokens=3, ignore_eos=True))
        ).json()["choices"][0]["message"]["content"]
    )
