"""Supervisor: a child server in its own process group, started, watched, stopped."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from vlmserve.engine.hf.lifecycle import ModelState
from vlmserve.errors import ConfigError
from vlmserve.gateway.supervisor import Supervisor, SupervisorConfig
from vlmserve.gateway.upstream import UpstreamConfig
from vlmserve.gateway.vllm import VllmBackend

# A server that answers /health and forks a grandchild (as vLLM forks engine workers).
SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    port = int(sys.argv[1])
    if len(sys.argv) > 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a): print("request", *a, flush=True)
    print("serving", port, flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def config(tmp_path: Path, *extra: str, **kw: float) -> SupervisorConfig:
    return SupervisorConfig(
        "fake/model", [sys.executable, "-c", SERVER, "{port}", *extra], log_dir=str(tmp_path), **kw
    )  # type: ignore[arg-type]


def family(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def gone(procs: list[psutil.Process], timeout: float = 5.0) -> bool:
    """Every process has exited (zombies count as gone), waiting up to ``timeout`` for the
    kernel to deliver the signals on a busy machine."""
    deadline = time.monotonic() + timeout
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_start_waits_for_health_and_stop_ends_the_whole_group(tmp_path: Path) -> None:
    sup = Supervisor(config(tmp_path))
    url = await sup.start()
    assert url == f"http://127.0.0.1:{sup.port}"
    async with httpx.AsyncClient() as client:
        assert (await client.get(url + "/health")).status_code == 200
    procs = family(sup.pid or 0)
    assert len(procs) == 2  # the server and its grandchild
    await asyncio.to_thread(sup.stop)
    assert gone(procs)
    assert "serving" in sup.log_path.read_text()
    assert sup.log_path.name == "fake_model.log"


async def test_a_child_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    sup = Supervisor(config(tmp_path, "ignore-term", stop_timeout=0.5))
    await sup.start()
    procs = family(sup.pid or 0)
    assert await asyncio.to_thread(sup.stop) == -9
    assert gone(procs)


async def test_a_command_that_exits_fails_start_with_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('bad flag {port}'); sys.exit(3)"]
    sup = Supervisor(SupervisorConfig("m", cmd, log_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match=r"exited with status 3.*bad flag"):
        await sup.start()


def test_command_needs_a_port_placeholder() -> None:
    with pytest.raises(ConfigError, match=r"\{port\}"):
        SupervisorConfig("m", ["vllm", "serve", "x"])


async def test_vllm_backend_goes_failed_when_its_child_dies(tmp_path: Path) -> None:
    sup = Supervisor(config(tmp_path))
    upstream = UpstreamConfig("m", health_interval=0, preflight=False)
    backend = VllmBackend("m", upstream, sup, watch_interval=0.05)
    await backend.aload()
    assert backend.state is ModelState.READY
    assert backend.describe()["replicas"][0]["url"] == sup.url
    psutil.Process(sup.pid or 0).kill()
    for _ in range(100):
        if backend.state is ModelState.FAILED:
            break
        await asyncio.sleep(0.05)
    assert backend.state is ModelState.FAILED
    assert "exited with status -9" in (backend.error or "")
    assert backend.describe()["process"]["exit_status"] == -9
    await backend.aclose()
    assert backend.describe()["replicas"] == []
