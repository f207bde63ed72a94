"""Bounds before work, measured on a real server process: what one cheap request can make the
server read, hold or stall. Peak RSS is the server's VmHWM, reset after the setup (uploads)
and before the request under test."""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import MODEL, ServerProcess

pytestmark = pytest.mark.slow

MiB = 2**20
HEAD_DEADLINE = 2.0  # seconds from connect to a request head's end (default 10)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def reset_peak(pid: int) -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_rise(pid: int, rss_before_kib: int) -> int:
    """Bytes the peak RSS rose over ``rss_before_kib`` since the last reset."""
    return (_status_kib(pid, "VmHWM") - rss_before_kib) * 1024


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("bounds-data")
    env = {
        "VLMSERVE_FILES_DIR": str(data),
        "VLMSERVE_SESSIONS_DB_PATH": str(data / "s.db"),
        "VLMSERVE_REQUEST_HEAD_TIMEOUT": str(HEAD_DEADLINE),
    }
    proc = ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--served-model-name",
            MODEL,
            "--device",
            "cpu",
            "--max-model-len",
            "8192",
        ],
        env=env,
        engine_process=True,
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def upload(url: str, data: bytes, purpose: str, name: str = "f.bin") -> str:
    files = {"file": (name, data)}
    answer = httpx.post(f"{url}/v1/files", files=files, data={"purpose": purpose}, timeout=120)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def test_forty_references_to_one_48_mib_file_are_refused_before_any_is_read(
    server: ServerProcess,
) -> None:
    # a PNG signature, then 48 MiB less a little: the largest upload the default allows
    file_id = upload(
        server.url, b"\x89PNG\r\n\x1a\n" + os.urandom(48 * MiB - 4096), "vision", "big.png"
    )
    parts = [{"type": "input_image", "file_id": file_id} for _ in range(40)]
    body = {
        "model": MODEL,
        "max_output_tokens": 2,
        "input": [{"role": "user", "content": [*parts, {"type": "input_text", "text": "?"}]}],
    }
    pid = server.proc.pid
    rss = _status_kib(pid, "VmRSS")
    reset_peak(pid)
    started = time.perf_counter()
    answer = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    seconds = time.perf_counter() - started
    rise = peak_rise(pid, rss)
    print(
        f"40 references: {answer.status_code} in {seconds * 1000:.0f} ms, peak RSS rose "
        f"{rise / MiB:.1f} MiB"
    )
    assert answer.status_code == 400, answer.text
    assert "VLMSERVE_MAX_MEDIA_PER_REQUEST" in answer.json()["error"]["message"]
    assert seconds < 1.0, f"{seconds:.2f} s"
    assert rise < 64 * MiB, f"peak RSS rose {rise / MiB:.0f} MiB"


class HealthProbe:
    """Polls ``/health`` from a thread every 20 ms; ``worst`` is the slowest answer (s).

    The test process's own collector is off meanwhile: its heap (torch, transformers, every
    test module) takes a full collection ~0.25 s on a slow 2-core machine, which would be
    counted as the server's stall."""

    def __init__(self, url: str):
        self.url, self.worst, self.count = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                assert http.get(f"{self.url}/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - started)
                self.count += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HealthProbe:
        gc.collect()
        gc.disable()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        gc.enable()


def test_health_stays_fast_while_a_44_mib_logprobs_answer_is_built_and_sent(
    tmp_path: Path,
) -> None:
    # n=8 x 4,000 tokens x 20 alternatives: ~50 MiB of JSON. The tiny model makes it in minutes
    # on a 2-core machine; a scripted backend (no model) gives the same chunks at once, so the
    # time is the server's own: collecting the choices, serialising and sending the answer.
    env = {"VLMSERVE_FILES_DIR": str(tmp_path), "VLMSERVE_SESSIONS_DB_PATH": str(tmp_path / "s.db")}
    command = [sys.executable, "-m", "vlmserve.testing.scripted_server"]
    server = ServerProcess(["--served-model-name", MODEL], env=env, command=command)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    try:
        server.wait_ready()
        with HealthProbe(server.url) as probe:
            started = time.perf_counter()
            answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            seconds = time.perf_counter() - started
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text[:500]
    print(
        f"{len(answer.content) / MiB:.1f} MiB answer in {seconds:.1f} s: worst /health "
        f"{probe.worst * 1000:.0f} ms of {probe.count}"
    )
    assert len(answer.content) >= 44 * MiB
    choices = answer.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(8))
    for choice in choices:
        content = choice["logprobs"]["content"]
        assert len(content) == 4000 and choice["finish_reason"] == "length"
        assert all(len(item["top_logprobs"]) == 20 for item in content)
    assert probe.count > 10 and probe.worst < 0.2, f"/health took {probe.worst * 1000:.0f} ms"


def _batch_file(target_bytes: int) -> bytes:
    """Chat request lines (~1.2 KB each) up to ``target_bytes``."""
    pad = "word " * 220
    lines, size, i = [], 0, 0
    while size < target_bytes:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": f"{i} {pad}"}],
        }
        line = (
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
            + "\n"
        )
        lines.append(line)
        size, i = size + len(line), i + 1
    return "".join(lines).encode()


def wait_status(url: str, batch_id: str, wanted: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()
        if batch["status"] in wanted:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch['status']}")


def test_four_batches_on_one_47_mib_file_hold_little_memory_and_never_stall(
    server: ServerProcess,
) -> None:
    data = _batch_file(47 * MiB)
    file_id = upload(server.url, data, "batch", "big.jsonl")
    pid = server.proc.pid
    rss = _status_kib(pid, "VmRSS")
    reset_peak(pid)
    made = []
    for _ in range(4):
        with HealthProbe(server.url) as probe:
            answer = httpx.post(
                f"{server.url}/v1/batches",
                timeout=60,
                json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
            )
            assert answer.status_code == 200, answer.text
            batch = wait_status(server.url, answer.json()["id"], ("in_progress", "failed"))
        assert batch["status"] == "in_progress", batch["errors"]
        assert batch["request_counts"]["total"] == data.count(b"\n")
        assert probe.worst < 0.2, f"/health took {probe.worst * 1000:.0f} ms during a create"
        made.append(batch["id"])
        print(f"create {len(made)}: worst /health {probe.worst * 1000:.0f} ms")
    rise = peak_rise(pid, rss)
    print(f"four batches: peak RSS rose {rise / MiB:.0f} MiB")
    for batch_id in made:
        httpx.post(f"{server.url}/v1/batches/{batch_id}/cancel", timeout=30)
    for batch_id in made:
        wait_status(server.url, batch_id, ("cancelled",))
    assert rise < 200 * MiB, f"peak RSS rose {rise / MiB:.0f} MiB"


def test_a_deleted_input_file_loses_no_finished_line_across_kill_9(
    tiny_dir: Path, tmp_path: Path
) -> None:
    env = {"VLMSERVE_FILES_DIR": str(tmp_path), "VLMSERVE_SESSIONS_DB_PATH": str(tmp_path / "s.db")}
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", MODEL, "--device", "cpu"]
    lines = [
        {
            "custom_id": f"k{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "max_tokens": 24,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Count {i}."}],
            },
        }
        for i in range(30)
    ]
    first = ServerProcess(args, env=env)
    try:
        first.wait_ready()
        file_id = upload(
            first.url, "".join(json.dumps(x) + "\n" for x in lines).encode(), "batch", "in.jsonl"
        )
        batch_id = httpx.post(
            f"{first.url}/v1/batches",
            timeout=30,
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
        ).json()["id"]
        assert httpx.delete(f"{first.url}/v1/files/{file_id}", timeout=30).status_code == 200
        deadline = time.monotonic() + 120
        while (
            httpx.get(f"{first.url}/v1/batches/{batch_id}").json()["request_counts"]["completed"]
            < 5
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.proc.kill()  # kill -9: no clean shutdown
        first.proc.wait()
    finally:
        first.stop()
    second = ServerProcess(args, env=env)
    try:
        second.wait_ready()
        batch = wait_status(second.url, batch_id, ("completed", "failed"), timeout=300)
        assert batch["status"] == "completed", batch["errors"]
        assert batch["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
        out = httpx.get(f"{second.url}/v1/files/{batch['output_file_id']}/content").text
        assert sorted(json.loads(x)["custom_id"] for x in out.splitlines()) == sorted(
            x["custom_id"] for x in lines
        )
    finally:
        second.stop()


def test_a_slow_request_head_gets_408_at_the_deadline_and_health_still_answers(
    server: ServerProcess,
) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"G")  # one byte, then a trickle: the deadline counts from connect
        time.sleep(HEAD_DEADLINE / 2)
        slow.sendall(b"E")
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        slow.settimeout(HEAD_DEADLINE + 5)
        answer = b""
        while chunk := slow.recv(4096):  # until the server closes the connection
            answer += chunk
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:80]
    assert b"connection: close" in answer and answer.endswith(b"request head not complete in time")
    assert HEAD_DEADLINE - 0.2 <= took < HEAD_DEADLINE + 1.5, f"closed after {took:.2f} s"
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
