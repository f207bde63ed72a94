"""Shared fixtures: the tiny real-architecture checkpoint, a loaded model, apps and servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from vlmserve.api.app import build_app
from vlmserve.config import Settings
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_qwen2_vl

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return build_qwen2_vl()


def make_settings(tiny_dir: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = {"model": str(tiny_dir), "served_model_name": MODEL, "device": "cpu"}
    return Settings(**{**base, **overrides})


@pytest.fixture(scope="session")
def chat_models(tiny_dir: Path) -> Iterator[ModelManager]:
    """One loaded tiny model shared by the whole session (loading is the slow part)."""
    manager = ModelManager.from_settings(make_settings(tiny_dir))
    for handle in manager.handles:
        handle.backend.load()
    yield manager
    manager.close()


AppFactory = Callable[..., Any]


@pytest.fixture
async def make_client(
    tiny_dir: Path, chat_models: ModelManager
) -> AsyncIterator[Callable[..., Any]]:
    """``async with make_client(**settings) as client`` — the app in-process over ASGI."""
    stack = contextlib.AsyncExitStack()

    async def factory(**overrides: Any) -> httpx.AsyncClient:
        app = build_app(make_settings(tiny_dir, **overrides), models=chat_models)
        await stack.enter_async_context(app.router.lifespan_context(app))
        transport = httpx.ASGITransport(app=app)
        client = httpx.AsyncClient(transport=transport, base_url="http://vlmserve.test", timeout=60)
        return await stack.enter_async_context(client)

    yield factory
    await stack.aclose()


@pytest.fixture
async def client(make_client: Callable[..., Any]) -> httpx.AsyncClient:
    return await make_client()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving ``build_app`` in a background thread on a free loopback port."""

    def __init__(self, app: Any):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def live_server(tiny_dir: Path, chat_models: ModelManager) -> Iterator[Callable[..., LiveServer]]:
    """``live_server(**settings)`` -> a started LiveServer sharing the loaded tiny model."""
    servers: list[LiveServer] = []

    def factory(**overrides: Any) -> LiveServer:
        server = LiveServer(build_app(make_settings(tiny_dir, **overrides), models=chat_models))
        servers.append(server.__enter__())
        return server

    yield factory
    for server in servers:
        server.__exit__()


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def vlmserve_cmd() -> list[str]:
    exe = shutil.which("vlmserve")
    return [exe] if exe else [sys.executable, "-m", "vlmserve.cli.main"]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*vlmserve_cmd(), *args, "--port", str(self.port)],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in time")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


REDIS_SERVER = shutil.which("redis-server")


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free loopback port, stopped after the test session."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
