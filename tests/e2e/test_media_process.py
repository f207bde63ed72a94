"""The media pipeline on a real server process: a flood of 20 MB images held to the media
memory budget (peak RSS of the server's processes, the excess answered 429), with the engine
in its own process and in the API process (16 requests in CI, 64 with ``--long``), and a
media worker killed with ``kill -9`` mid-decode (its request retried, the worker replaced)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from support import MODEL, ServerProcess

pytestmark = pytest.mark.slow

MiB = 2**20


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the engine process, the media workers, their resource
    tracker). Each thread lists the children it started: the engine process is started from
    a worker thread, so every thread's list is read, not the main thread's alone."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the thread or process is gone
                todo.extend(int(c) for c in children.read_text().split())
    return out


def _kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peaks(pids: list[int]) -> None:
    for pid in pids:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")


class TreeSampler:
    """The peak of the summed RSS of ``pids`` (KiB), sampled every 5 ms from a thread: the
    processes peak at different moments, so the sum of their own peaks would overstate it."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak = pids, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(_kib(p, "VmRSS") for p in self.pids))
            self._stop.wait(0.005)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A 2200x1650 noise JPEG at quality 100: ~14 MB, ~19 MB as base64 (~11 MB of pixels)."""
    size = (2200, 1650)
    image = Image.frombytes("RGB", size, random.Random(4).randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=100, subsampling=0)
    return buf.getvalue()


def _chat(photo: bytes) -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    return httpx.Request("POST", "/", json={**body, "max_tokens": 4, "temperature": 0}).content


def _server(
    tiny_dir: Path, *flags: str, engine_process: bool = True, env: dict[str, str] | None = None
) -> ServerProcess:
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", MODEL, "--device", "cpu"]
    flags = ("--max-model-len", "8192", *flags)
    return ServerProcess([*args, *flags], env, engine_process=engine_process)


def _flooded(tiny_dir: Path, flood_size: int, engine_process: bool) -> Iterator[ServerProcess]:
    """A server with a 256 MiB media budget and one media worker. In CI a shorter queue keeps
    the flood of 16 small enough to finish in seconds and still overflow the budget;
    ``--long`` floods it with 64."""
    env = {"VLMSERVE_MEDIA_QUEUE": "4"} if flood_size < 64 else None
    flags = ("--media-memory", "256MiB", "--media-workers", "1")
    proc = _server(tiny_dir, *flags, engine_process=engine_process, env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def flood_server(tiny_dir: Path, flood_size: int) -> Iterator[ServerProcess]:
    """The engine in its own process (the default)."""
    yield from _flooded(tiny_dir, flood_size, engine_process=True)


@pytest.fixture(scope="module")
def in_process_server(tiny_dir: Path, flood_size: int) -> Iterator[ServerProcess]:
    """The engine in the API process (``--no-engine-process``): the engine's media and the
    processor's tensors live beside the API's own (the cycle that once held every answered
    request's media is pinned by tests/unit/engine/hf/test_media_release.py)."""
    yield from _flooded(tiny_dir, flood_size, engine_process=False)


@pytest.fixture(scope="module")
def flood_size(request: pytest.FixtureRequest) -> int:
    return 64 if request.config.getoption("--long", default=False) else 16


async def _flood(url: str, body: bytes, n: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        calls = [
            client.post("/v1/chat/completions", content=body, headers=headers) for _ in range(n)
        ]
        return list(await asyncio.gather(*calls))


def test_a_flood_of_20_mb_images_holds_to_the_media_memory_and_the_excess_gets_429(
    flood_server: ServerProcess, photo: bytes, flood_size: int
) -> None:
    _flood_holds_to_the_budget(flood_server, photo, flood_size)


def test_with_the_engine_in_the_api_process_the_flood_holds_to_the_media_memory_too(
    in_process_server: ServerProcess, photo: bytes, flood_size: int
) -> None:
    _flood_holds_to_the_budget(in_process_server, photo, flood_size)


def _flood_holds_to_the_budget(flood_server: ServerProcess, photo: bytes, n: int) -> None:
    body = _chat(photo)
    assert 18 * MiB < len(body) < 21 * MiB
    first = httpx.post(
        f"{flood_server.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    expected = first.json()["choices"][0]["message"]["content"]
    warm = asyncio.run(_flood(flood_server.url, body, 4))  # the threads' first allocations
    assert {a.status_code for a in warm} == {200}
    server = flood_server.proc.pid
    _settle(server)  # the engine's image preprocessing workers, started by the first image
    pids = _tree(server)
    before, api_before = sum(_kib(p, "VmRSS") for p in pids), _kib(server, "VmRSS")
    _reset_peaks(pids)
    with TreeSampler(pids) as sampled:
        answers = asyncio.run(_flood(flood_server.url, body, n))
    rise = (sampled.peak - before) * 1024
    api_rise = (_kib(server, "VmHWM") - api_before) * 1024
    statuses = sorted(a.status_code for a in answers)
    print(
        f"{n} x {len(body) / MiB:.1f} MiB: {statuses.count(200)} answered, "
        f"{statuses.count(429)} got 429; peak RSS of the server's processes rose "
        f"{rise / MiB:.0f} MiB (the API process's own peak: {api_rise / MiB:.0f} MiB)"
    )
    assert set(statuses) <= {200, 429}, [a.text[:200] for a in answers if a.status_code >= 400]
    refused = [a for a in answers if a.status_code == 429]
    assert refused and all(int(a.headers["retry-after"]) >= 1 for a in refused)
    assert "VLMSERVE_MEDIA_MEMORY" in refused[0].json()["error"]["message"]
    accepted = [a for a in answers if a.status_code == 200]
    assert accepted and all(
        a.json()["choices"][0]["message"]["content"] == expected for a in accepted
    )
    assert rise <= 256 * MiB + 256 * MiB, f"peak RSS rose {rise / MiB:.0f} MiB"
    assert api_rise <= 256 * MiB + 256 * MiB, f"the API's peak RSS rose {api_rise / MiB:.0f} MiB"


def _children(pid: int) -> list[int]:
    out = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out.extend(int(c) for c in children.read_text().split())
    return out


def _settle(server: int, timeout: float = 90.0) -> None:
    """Until the summed RSS of the server's processes has held within 8 MiB for 2 s: the
    processes the first image started (a process with torch loaded) have loaded."""
    deadline, last, steady = time.monotonic() + timeout, -1, 0
    while time.monotonic() < deadline:
        total = sum(_kib(p, "VmRSS") for p in _tree(server))
        steady = steady + 1 if abs(total - last) < 8 * 1024 else 0
        if steady >= 4:
            return
        last = total
        time.sleep(0.5)
    raise AssertionError(f"the server's processes did not settle in {timeout:.0f} s")


def _media_workers(server: int) -> list[int]:
    """The API process's spawned multiprocessing children (not the resource tracker, not the
    engine process, nor the engine process's own image preprocessing workers)."""
    found = []
    for pid in _children(server):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_media_worker_killed_mid_decode_is_replaced_and_its_request_retried(
    flood_server: ServerProcess, photo: bytes
) -> None:
    server = flood_server.proc.pid
    workers = _media_workers(server)
    assert len(workers) == 1, workers
    (worker,) = workers
    idle = _cpu_ticks(worker)
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["answer"] = httpx.post(
            f"{flood_server.url}/v1/chat/completions",
            content=_chat(photo),
            headers={"content-type": "application/json"},
            timeout=120,
        )

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while _cpu_ticks(worker) < idle + 5:  # 50 ms into its decode
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(worker, signal.SIGKILL)
    thread.join(120)
    answer = result["answer"]
    assert answer.status_code == 200, answer.text
    replaced = _media_workers(server)
    assert len(replaced) == 1 and replaced != [worker], replaced
    again = httpx.post(
        f"{flood_server.url}/v1/chat/completions",
        content=_chat(photo),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert again.status_code == 200, again.text
