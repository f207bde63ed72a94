"""Shared fixtures: the tiny real-architecture checkpoint, a loaded model, apps and servers."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from alone import AloneLastScheduling, check_entries
from support import MODEL, LiveServer, free_port, make_settings  # noqa: F401
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_qwen2_vl


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return build_qwen2_vl()


@pytest.fixture(scope="session")
def chat_models(tiny_dir: Path) -> Iterator[ModelManager]:
    """One loaded tiny model shared by the whole session (loading is the slow part)."""
    manager = ModelManager.from_settings(make_settings(tiny_dir))
    for handle in manager.handles:
        handle.backend.load()
    yield manager
    manager.close()


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


@pytest.fixture
def live_server(
    tiny_dir: Path, chat_models: ModelManager, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., LiveServer]]:
    """``live_server(**settings)`` -> a started LiveServer sharing the loaded tiny model (its
    uploaded files in a temporary directory, never the working tree)."""
    servers: list[LiveServer] = []

    def factory(**overrides: Any) -> LiveServer:
        overrides.setdefault("files_dir", str(tmp_path_factory.mktemp("files")))
        server = LiveServer(build_app(make_settings(tiny_dir, **overrides), models=chat_models))
        servers.append(server.__enter__())
        return server

    yield factory
    for server in servers:
        server.__exit__()


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
    args = [
        REDIS_SERVER,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="robustness suite in release mode: more fuzz examples, fault runs, longer load",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "robustness: hostile-input, fault and load suite")
    check_entries(config.rootpath)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a release check, heavier than CI allows: runs with --long")
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Load balancing by file with the timing tests alone at the end (tests/alone.py)."""
    if config.getvalue("dist") in ("load", "loadfile"):
        return AloneLastScheduling(config, log)
    return None
