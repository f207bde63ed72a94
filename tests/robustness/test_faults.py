"""Faults: clients that vanish mid-stream, and SIGTERM with streams in flight.

Disconnects run against a real uvicorn (sockets closed at random points). With a short
``cancel_after_disconnect_seconds`` the generation must stop; with the default it must finish
and stay resumable. Either way in-flight gauges, the server loop's asyncio tasks and this
process's open descriptors return to their baseline.

SIGTERM runs a real ``vlmserve serve`` process: after the signal new requests are refused (503,
or connection refused once the socket is closed), the in-flight streams finish, the process
exits 0 within the drain timeout, and leaves no child process behind.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from conftest import Scale, metric, open_fds
from support import MODEL, ServerProcess

pytestmark = pytest.mark.robustness

LONG_STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


def _open_stream(port: int, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    return s


def _read_events_then_drop(port: int, events: int) -> str | None:
    """Read ``events`` SSE events (0: just the headers), then close; returns the session id."""
    s = _open_stream(port, LONG_STREAM)
    data = b""
    try:
        while data.count(b"\n\n") < events + 1:  # headers end with a blank line too
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # RST at a random point of the stream
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"x-session-id:"):
            return line.split(b":", 1)[1].strip().decode()
    return None


def _server_loop(server: Any) -> asyncio.AbstractEventLoop:
    return server.server.servers[0].get_loop()


def _tasks(server: Any) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), _server_loop(server)).result(5)


def _settled(server: Any, app: Any, deadline: float) -> dict[str, float]:
    """Wait until nothing is in flight; returns what was measured at the end."""
    handle = app.state.services.models.handles[0]
    while True:
        text = httpx.get(f"{server.url}/metrics").text
        state = {
            "handle_in_flight": handle.in_flight,
            "backend_in_flight": handle.backend.in_flight,
            "active_sessions": app.state.services.sessions.active_count(),
            "requests_in_flight": metric(text, "vlmserve_requests_in_flight") - 1,  # this scrape
        }
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["cancel", "continue"])
def test_random_disconnects_leave_no_residue(live_server: Any, scale: Scale, policy: str) -> None:
    cancel_after = 0.2 if policy == "cancel" else 3600.0
    server = live_server(cancel_after_disconnect_seconds=cancel_after, max_tokens=400)
    app = server.server.config.app
    rng = random.Random(1234)
    runs = scale.disconnects if policy == "cancel" else max(4, scale.disconnects // 5)
    _settled(server, app, time.monotonic() + 5)
    fds0, tasks0 = open_fds(), _tasks(server)
    tokens0 = app.state.services.models.handles[0].backend.tokens_generated
    started = time.monotonic()
    sessions = []
    for batch in range(0, runs, 4):  # four concurrent streams at a time
        threads, ids = [], []
        drop = ids.append
        for _ in range(min(4, runs - batch)):
            cut = rng.randint(0, 12)
            t = threading.Thread(
                target=lambda c=cut, d=drop: d(_read_events_then_drop(server.port, c))
            )
            t.start()
            threads.append(t)
        for t in threads:
            t.join(30)
        sessions += ids
    state = _settled(server, app, time.monotonic() + 60)
    settle = time.monotonic() - started
    tokens = app.state.services.models.handles[0].backend.tokens_generated - tokens0
    time.sleep(0.3)  # let closed sockets and finished tasks be collected
    fds, tasks = open_fds(), _tasks(server)
    print(
        f"\n{policy}: {runs} disconnects, settled in {settle:.1f}s, tokens {tokens} "
        f"(cap {runs * 400}), fds {fds0}->{fds}, tasks {tasks0}->{tasks}, {state}"
    )
    assert not any(state.values()), state
    assert fds <= fds0 + 2 and tasks <= tasks0 + 2
    if policy == "cancel":
        assert tokens < runs * 400 * 0.5  # generation stopped well before max_tokens
    else:
        assert tokens >= runs * 400 * 0.99  # every stream ran to its end
        sid = next(s for s in sessions if s)
        replay = httpx.get(f"{server.url}/v1/streams/{sid}", params={"after": -1}, timeout=30)
        assert replay.status_code == 200 and '"finish_reason":"length"' in replay.text.replace(
            " ", ""
        )


# -- SIGTERM with streams in flight --------------------------------------------------------


def _stream_to_end(url: str, out: list[Any]) -> None:
    body = {**LONG_STREAM, "max_tokens": 2400}  # ~3.5 s for 6 streams at 4,000 tok/s
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            text = "".join(r.iter_text())
        out.append((r.status_code, '"finish_reason":"length"' in text.replace(" ", "")))
    except httpx.HTTPError as exc:
        out.append((0, type(exc).__name__))


def test_sigterm_drains_streams_refuses_new_work_and_exits_clean(
    tiny_dir: Path, scale: Scale
) -> None:
    for run in range(scale.fault_runs):
        proc = ServerProcess(
            ["serve", "--model", str(tiny_dir), "--served-model-name", MODEL, "--device", "cpu"]
        )
        try:
            proc.wait_ready()
            results: list[Any] = []
            threads = [
                threading.Thread(target=_stream_to_end, args=(proc.url, results)) for _ in range(6)
            ]
            for t in threads:
                t.start()
            time.sleep(1.0)  # streams are producing
            assert results == [], "streams finished before the signal; make them longer"
            children = psutil.Process(proc.proc.pid).children(recursive=True)
            signalled = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            try:
                small = {**LONG_STREAM, "stream": False, "max_tokens": 2}
                url = f"{proc.url}/v1/chat/completions"
                late = httpx.post(url, json=small, timeout=5).status_code
            except httpx.TransportError:
                late = "refused"
            for t in threads:
                t.join(60)
            code = proc.proc.wait(timeout=40)
            took = time.monotonic() - signalled
        finally:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()
        # The resource tracker reads EOF once the server and its workers are gone: allow it
        # the moment that takes; a process still alive after that outlived the server.
        _, alive = psutil.wait_procs(children, timeout=3)
        orphans = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        print(
            f"\nSIGTERM run {run}: streams {results}, new request -> {late}, exit {code} "
            f"after {took:.1f}s, orphans {len(orphans)}"
        )
        assert late in (503, "refused")
        assert results and all(r == (200, True) for r in results), results
        # uvicorn re-raises the SIGTERM it handled once shutdown is complete, so a clean drain
        # ends as "terminated by SIGTERM" (-15; systemd counts it as success), never as 1 or -9.
        assert code in (0, -signal.SIGTERM) and took < 32
        assert took > 1.0, "the streams were not in flight when the signal came"
        assert orphans == [], [c.cmdline() for c in orphans]
