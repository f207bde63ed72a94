"""Fixtures for the streaming tests: a real redis-server, stores, fake producers."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlmserve.streaming import Emit, Event, MemoryStore, RedisStore, SessionStore, SQLiteStore

REDIS_SERVER = shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
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


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_url, ttl=60, prefix=f"t{uuid.uuid4().hex[:8]}")
    yield store
    await store.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "streams.db", ttl=60)
    yield store
    await store.close()


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionStore]:
    """Each store kind in turn (redis skips when the binary is absent)."""
    store: SessionStore
    if request.param == "memory":
        store = MemoryStore(ttl=60)
    elif request.param == "sqlite":
        store = SQLiteStore(tmp_path / "streams.db", ttl=60)
    else:
        store = RedisStore(request.getfixturevalue("redis_url"), ttl=60, prefix=uuid.uuid4().hex)
    yield store
    await store.close()


@dataclass
class Counter:
    """What a fake producer did: how many emits it made, whether it was closed early."""

    produced: int = 0
    closed: bool = False


def numbered(
    n: int, *, delay: float = 0.0, start: int = 0, counter: Counter | None = None,
    fail_at: int | None = None, every: int = 1,
) -> AsyncIterator[Emit]:  # fmt: skip
    """Yields Emit(data='{"i": i}') for i in [start, n); sleeps ``delay`` every ``every`` items."""

    async def gen() -> AsyncIterator[Emit]:
        try:
            for i in range(start, n):
                if delay and i % every == 0:
                    await asyncio.sleep(delay)
                if i == fail_at:
                    raise RuntimeError(f"backend failed at {i}")
                if counter is not None:
                    counter.produced += 1
                yield Emit(json.dumps({"i": i}), meta={"token": i})
        except GeneratorExit:
            if counter is not None:
                counter.closed = True
            raise
        except asyncio.CancelledError:
            if counter is not None:
                counter.closed = True
            raise

    return gen()


@pytest.fixture
def producer() -> Callable[..., AsyncIterator[Emit]]:
    return numbered


def no_cancel_emits() -> list[Emit]:
    return [Emit(json.dumps({"cancelled": True}), meta={"finish_reason": "cancelled"})]


def error_emits(exc: BaseException) -> list[Emit]:
    return [Emit(json.dumps({"error": str(exc)}), event="error")]


@pytest.fixture
def callbacks() -> dict[str, Callable[..., list[Emit]]]:
    return {"on_cancel": no_cancel_emits, "on_error": error_emits}


async def collect(listener: AsyncIterator[Event], limit: int | None = None) -> list[Event]:
    """Events until the listener ends, or the first ``limit`` ones; closes the listener."""
    out: list[Event] = []
    try:
        async for event in listener:
            out.append(event)
            if limit is not None and len(out) >= limit:
                break
    finally:
        await listener.aclose()  # type: ignore[attr-defined]
    return out


@pytest.fixture
def drain() -> Callable[..., object]:
    return collect


@pytest.fixture
def counter() -> Counter:
    return Counter()
