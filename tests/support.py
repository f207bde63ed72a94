"""Test helpers shared across the suite (a plain module: ``conftest`` names collide)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import uvicorn

from vlmserve.config import Settings

MODEL = "tiny"


def make_settings(tiny_dir: Path, **overrides: Any) -> Settings:
    # in process: tests reach into the engine (tests/integration/test_engine_process.py and
    # the real servers of tests/e2e run the default, an engine process)
    base: dict[str, Any] = {
        "model": str(tiny_dir),
        "served_model_name": MODEL,
        "device": "cpu",
        "engine_process": False,
        "media_workers": 0,  # decode on a thread: no worker processes per test app
    }
    return Settings(**{**base, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving ``build_app`` in a background thread on a free loopback port."""

    def __init__(self, app: Any, port: int | None = None):
        self.port = port or free_port()
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


def vlmserve_cmd() -> list[str]:
    exe = shutil.which("vlmserve")
    return [exe] if exe else [sys.executable, "-m", "vlmserve.cli.main"]


class ServerProcess:
    """A real ``vlmserve`` process. Its output goes to a temporary file, never a pipe: a
    pipe nobody reads fills up (access logs) and blocks the server's event loop."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        engine_process: bool = False,
        command: list[str] | None = None,
    ):
        """``engine_process``: the product's default, an engine process per chat model. Off
        unless a test asks (or ``env`` sets VLMSERVE_ENGINE_PROCESS): starting one costs a
        second interpreter, ~5 s a server on a 2-core CI machine. ``command``: the program
        (default ``vlmserve``), ``args`` and ``--port`` follow it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        engine = {"VLMSERVE_ENGINE_PROCESS": "1" if engine_process else "0"}
        self.proc = subprocess.Popen(
            [*(command or vlmserve_cmd()), *args, "--port", str(self.port)],
            env={**os.environ, **engine, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
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
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        out = self.output()
        self.log.close()
        return out


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>`` (a path under it, e.g. ``peers/ttft.py``) imported as module
    ``benchmark_<stem>``, with ``benchmarks/`` importable (its scripts import ``peers``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    path = BENCHMARKS / script
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


@contextlib.contextmanager
def benchmark_module(script: str) -> Iterator[ModuleType]:
    """``import_benchmark(script)`` for the duration."""
    module = import_benchmark(script)
    try:
        yield module
    finally:
        del sys.modules[module.__name__]
