"""A supervised server subprocess (``vllm serve ...``, or any command that serves ``/health``).

``start`` fills ``{port}`` in the argv with a free loopback port, starts the command in its own
process group (so stopping it stops its children too: vLLM forks engine workers) with output
to one log file per model, and waits for ``GET /health`` to answer 2xx. ``stop`` sends SIGTERM
to the group, then SIGKILL after ``stop_timeout``. ``exited`` tells whether it died on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from vlmserve.errors import ConfigError

__all__ = ["Supervisor", "SupervisorConfig", "free_port"]

log = logging.getLogger(__name__)
PORT = "{port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(slots=True)
class SupervisorConfig:
    name: str  # the model's name (log file, messages)
    command: list[str]  # argv, never a shell; "{port}" is replaced by the chosen port
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    health_timeout: float = 600.0  # seconds to wait for /health after starting
    stop_timeout: float = 30.0  # SIGTERM, then SIGKILL after this long
    log_dir: str | None = None  # default: the working directory's ``logs/``
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(a, str) and a for a in self.command):
            raise ConfigError(
                f"model {self.name!r}: backend_config.command must be a non-empty argv list, "
                'e.g. ["vllm", "serve", "/models/x", "--port", "{port}"]'
            )
        if not any(PORT in a for a in self.command):
            raise ConfigError(
                f"model {self.name!r}: backend_config.command needs a {PORT} "
                'placeholder for the port, e.g. "--port", "{port}"'
            )


class Supervisor:
    """One child server process; see the module docstring."""

    def __init__(self, config: SupervisorConfig):
        self.config = config
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.config.name)
        return Path(self.config.log_dir or "logs") / f"{safe}.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def exited(self) -> bool:
        """Started, and died on its own (stop() clears the process first)."""
        return self.process is not None and self.process.poll() is not None

    def argv(self, port: int) -> list[str]:
        return [a.replace(PORT, str(port)) for a in self.config.command]

    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> str:
        """Start the command and wait until it serves; returns its base URL."""
        self.port = free_port(self.config.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held for the child's lifetime
        argv = self.argv(self.port)
        log.info("starting %s: %s (log: %s)", self.config.name, " ".join(argv), self.log_path)
        try:
            self.process = subprocess.Popen(
                argv,
                env={**os.environ, **self.config.env},
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise ConfigError(f"model {self.config.name!r}: cannot run {argv[0]!r}: {exc}") from exc
        self.started_at = time.time()
        try:
            await self._wait_healthy(transport)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self.url

    async def _wait_healthy(self, transport: httpx.AsyncBaseTransport | None) -> None:
        deadline = time.monotonic() + self.config.health_timeout
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.exited():
                    raise RuntimeError(
                        f"{self.config.name} exited with status {self.returncode} while "
                        f"starting; {self._tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).is_success:
                        return
                await asyncio.sleep(0.25)
        raise RuntimeError(
            f"{self.config.name} did not answer /health within "
            f"{self.config.health_timeout:.0f}s (backend_config.health_timeout); "
            f"{self._tail()}"
        )

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``stop_timeout``; returns the status."""
        process, self.process = self.process, None
        if process is None:
            return None
        code = process.poll()
        if code is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                code = process.wait(self.config.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s ignored SIGTERM for %.0fs; killing it",
                    self.config.name,
                    self.config.stop_timeout,
                )
                _signal_group(process.pid, signal.SIGKILL)
                code = process.wait()
        _signal_group(process.pid, signal.SIGKILL)  # children that outlived their parent
        self._close_log()
        return code

    def describe(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "port": self.port,
            "log": str(self.log_path),
            "returncode": self.returncode,
            "started_at": self.started_at,
        }

    def _tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return f"see {self.log_path}"
        return f"last log lines ({self.log_path}): " + " | ".join(text)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
