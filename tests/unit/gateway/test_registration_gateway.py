"""The gateway side of registration: only an ``openai`` entry takes workers as replicas; a
``vllm`` entry (its one replica is the process it runs) and a local model answer a 400 that
says so, and keep the replicas they had."""

from __future__ import annotations

import sys

import httpx
import pytest

from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.supervisor import Supervisor, SupervisorConfig
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.gateway.vllm import VllmBackend
from vlmserve.registry.handles import ModelHandle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted_backend import LogprobsBackend

ADMIN = {"Authorization": "Bearer adm"}


def _upstream(name: str) -> UpstreamConfig:
    return UpstreamConfig(model=name, health_interval=0, policy=PoolPolicy(max_failures=1))


@pytest.fixture
async def gateway() -> httpx.AsyncClient:
    command = [sys.executable, "-c", "print({port})"]  # never started here
    vllm = VllmBackend("gw-vllm", _upstream("gw-vllm"), Supervisor(SupervisorConfig("v", command)))
    models = ModelManager(
        [
            ModelHandle("gw-vllm", ["chat"], vllm),
            ModelHandle("gw-open", ["chat"], UpstreamBackend("gw-open", _upstream("gw-open"))),
            ModelHandle("local", ["chat"], LogprobsBackend("local")),
        ]
    )
    app = build_app(Settings(admin_keys=["adm"]), models=models)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client


async def _register(gateway: httpx.AsyncClient, model: str) -> httpx.Response:
    body = {"model": model, "url": "http://127.0.0.1:9", "instance": "w-1"}
    return await gateway.post("/v1/gateway/register", json=body, headers=ADMIN)


@pytest.mark.parametrize(("model", "kind"), [("gw-vllm", "vllm"), ("local", "hf")])
async def test_a_worker_cannot_join_an_entry_that_is_not_an_openai_upstream(
    gateway: httpx.AsyncClient, model: str, kind: str
) -> None:
    answer = await _register(gateway, model)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {
        "message": f"model {model!r} is a {kind} entry, not an openai (upstream) entry; "
        'replicas register only with `backend = "openai"` entries of the gateway\'s registry',
        "type": "invalid_request_error",
        "param": "model",
        "code": "not_an_upstream",
    }
    listed = (await gateway.get("/v1/gateway/replicas", headers=ADMIN)).json()["models"]
    assert all(m["replicas"] == [] for m in listed), listed


async def test_a_worker_joins_an_openai_entry(gateway: httpx.AsyncClient) -> None:
    answer = await _register(gateway, "gw-open")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "gw-open" and answer.json()["registered"] is True
    listed = {
        m["model"]: [r["url"] for r in m["replicas"]]
        for m in (await gateway.get("/v1/gateway/replicas", headers=ADMIN)).json()["models"]
    }
    assert listed == {"gw-vllm": [], "gw-open": ["http://127.0.0.1:9"]}
