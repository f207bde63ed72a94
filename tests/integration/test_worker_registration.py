"""A worker registers itself with a gateway on start and leaves its pool on a clean stop."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from support import MODEL, LiveServer, free_port, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.registry.manager import ModelManager

ADMIN = {"Authorization": "Bearer adm"}


def _replicas(gateway: str) -> list[dict]:
    r = httpx.get(f"{gateway}/v1/gateway/replicas", headers=ADMIN, timeout=10)
    r.raise_for_status()
    return r.json()["models"][0]["replicas"]


def _wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_worker_registers_on_start_serves_then_deregisters_on_stop(
    tmp_path: Path, tiny_dir: Path, chat_models: ModelManager
) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(
        '[[models]]\nname = "gw-tiny"\nbackend = "openai"\n'
        f'served_model_id = "{MODEL}"\n[models.backend_config]\nbase_urls = []\n'
    )
    gw_settings = Settings(registry=str(registry), device="cpu", admin_keys=["adm"])
    with LiveServer(build_app(gw_settings)) as gateway:
        port = free_port()
        worker_settings = make_settings(
            tiny_dir,
            register_url=f"{gateway.url}/v1/gateway/register",
            advertise_url=f"http://127.0.0.1:{port}",
            gateway_key="adm",
            instance_id="worker-1",
        )
        with LiveServer(build_app(worker_settings, models=chat_models), port=port):
            _wait_for(lambda: len(_replicas(gateway.url)) == 1)
            assert _replicas(gateway.url)[0]["url"].startswith(f"http://127.0.0.1:{port}")
            r = httpx.post(
                f"{gateway.url}/v1/chat/completions",
                json={
                    "model": "gw-tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
        _wait_for(lambda: _replicas(gateway.url) == [])
