"""Idle watchdog: deregister first, then the idle command exactly once, never while busy."""

from __future__ import annotations

import asyncio
import errno
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from vlmserve import watchdog
from vlmserve.errors import ConfigError
from vlmserve.watchdog import (
    ActivityClock,
    CommandDeregisterHook,
    HttpDeregisterHook,
    IdleWatchdog,
)

# Appends "<label> <time>" to a file: the order file records who ran when.
RECORDER = """
import sys, time
with open(sys.argv[1], "a") as f:
    f.write(f"{sys.argv[2]} {time.time()}\\n")
"""


@pytest.fixture
def recorder(tmp_path: Path) -> Callable[[str], list[str]]:
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    order = tmp_path / "order.txt"

    def argv(label: str) -> list[str]:
        return [sys.executable, str(script), str(order), label]

    return argv


def lines(tmp_path: Path) -> list[str]:
    order = tmp_path / "order.txt"
    return [line.split()[0] for line in order.read_text().splitlines()] if order.exists() else []


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def started() -> AsyncIterator[list[IdleWatchdog]]:
    dogs: list[IdleWatchdog] = []
    yield dogs
    for dog in dogs:
        await dog.stop()


def make(clock: ActivityClock, dogs: list[IdleWatchdog], **kw) -> IdleWatchdog:
    dog = IdleWatchdog(clock, idle_seconds=0.3, check_interval=0.05, **kw)
    dog.start()
    dogs.append(dog)
    return dog


async def test_idle_command_runs_exactly_once_after_the_idle_period(
    tmp_path: Path, recorder, started
) -> None:
    clock = ActivityClock()
    dog = make(clock, started, idle_command=recorder("command"))
    await asyncio.sleep(0.15)
    assert lines(tmp_path) == []  # not idle long enough yet
    await wait_until(lambda: lines(tmp_path) == ["command"])
    await asyncio.sleep(0.6)  # several more idle periods
    assert lines(tmp_path) == ["command"]
    assert dog.fired and dog.exit_code == 0


async def test_never_runs_while_a_request_is_in_flight(tmp_path: Path, recorder, started) -> None:
    clock = ActivityClock()
    make(clock, started, idle_command=recorder("command"))
    with clock.busy():
        await asyncio.sleep(1.0)
        assert lines(tmp_path) == []
    released = time.time()
    await wait_until(lambda: lines(tmp_path) == ["command"])
    ran_at = float((tmp_path / "order.txt").read_text().split()[1])
    assert ran_at - released >= 0.3  # idle counts from the end of the request


async def test_http_deregistration_is_called_before_the_command(
    tmp_path: Path, recorder, started
) -> None:
    posts: list[tuple[float, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        posts.append((time.time(), json.loads(request.content)))
        return httpx.Response(200)

    hook = HttpDeregisterHook(
        "http://registry.test/deregister",
        instance="i-123",
        transport=httpx.MockTransport(handler),
    )
    make(ActivityClock(), started, idle_command=recorder("command"), deregister=hook)
    await wait_until(lambda: lines(tmp_path) == ["command"])
    ran_at = float((tmp_path / "order.txt").read_text().split()[1])
    assert [body for _, body in posts] == [{"instance": "i-123", "reason": "idle"}]
    assert posts[0][0] < ran_at


async def test_command_deregistration_runs_before_the_command(
    tmp_path: Path, recorder, started
) -> None:
    hook = CommandDeregisterHook(recorder("deregister"))
    make(ActivityClock(), started, idle_command=recorder("command"), deregister=hook)
    await wait_until(lambda: len(lines(tmp_path)) == 2)
    assert lines(tmp_path) == ["deregister", "command"]


@pytest.mark.parametrize("failure", ["http-500", "connect-error", "exit-1", "hangs"])
async def test_a_failing_hook_does_not_prevent_the_command(
    tmp_path: Path, recorder, started, failure: str
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if failure == "connect-error":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(500)

    async def hangs() -> None:
        await asyncio.sleep(3600)

    hooks = {
        "http-500": HttpDeregisterHook("http://r.test/", transport=httpx.MockTransport(handler)),
        "connect-error": HttpDeregisterHook(
            "http://r.test/", transport=httpx.MockTransport(handler)
        ),
        "exit-1": CommandDeregisterHook([sys.executable, "-c", "raise SystemExit(1)"]),
        "hangs": hangs,
    }
    make(
        ActivityClock(),
        started,
        idle_command=recorder("command"),
        deregister=hooks[failure],
        hook_timeout=0.3,
    )
    await wait_until(lambda: lines(tmp_path) == ["command"])


@pytest.mark.parametrize("bad", ["sudo shutdown -h now", [], ["ok", ""], ["ok", 3], None])
def test_idle_command_must_be_a_non_empty_argv_list(bad) -> None:
    if bad is None:
        IdleWatchdog(ActivityClock(), idle_seconds=1, idle_command=None)  # allowed: no command
        return
    with pytest.raises(ConfigError) as info:
        IdleWatchdog(ActivityClock(), idle_seconds=1, idle_command=bad)
    if isinstance(bad, str):
        assert "list" in str(info.value)


def test_activity_file_is_written_atomically_and_at_most_once_a_second(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / "last_activity"
    clock = ActivityClock(path, monotonic=lambda: now[0])
    first = float(path.read_text())
    assert abs(first - time.time()) < 5
    time.sleep(0.01)
    clock.touch()  # same monotonic second: not rewritten
    assert float(path.read_text()) == first
    now[0] += 1.0
    clock.touch()
    assert float(path.read_text()) > first
    assert [p.name for p in tmp_path.iterdir()] == ["last_activity"]  # no temp files left


def test_idle_for_and_in_flight_are_thread_safe() -> None:
    clock = ActivityClock()

    def work() -> None:
        for _ in range(2000):
            with clock.busy():
                pass

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.in_flight == 0
    assert clock.idle_for() < 1.0


async def test_an_idle_command_the_kernel_cannot_start_yet_is_retried(
    tmp_path: Path, recorder, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = subprocess.Popen
    refusals = [OSError(errno.ENOMEM, "Cannot allocate memory")] * 2

    def spawn(*args, **kw):
        if refusals:
            raise refusals.pop()
        return real(*args, **kw)

    monkeypatch.setattr(watchdog, "SPAWN_BACKOFF", 0.01)
    monkeypatch.setattr(subprocess, "Popen", spawn)
    dog = make(ActivityClock(), started, idle_command=recorder("command"))
    await wait_until(lambda: dog.exit_code == 0)
    assert lines(tmp_path) == ["command"] and refusals == []


async def test_an_idle_command_that_does_not_exist_is_not_retried(
    tmp_path: Path, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = subprocess.Popen

    def spawn(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(watchdog, "SPAWN_BACKOFF", 0.01)
    monkeypatch.setattr(subprocess, "Popen", spawn)
    dog = make(ActivityClock(), started, idle_command=[str(tmp_path / "no-such-command")])
    await wait_until(lambda: dog.fired)
    await asyncio.sleep(0.3)
    assert len(calls) == 1 and dog.exit_code is None


# A process holding one writable mapping larger than RAM + swap (as a server whose KV caches
# outgrow RAM does): the kernel cannot account for it in a fork's copy, so fork() fails, and
# uvloop's spawn forks. Built as adjacent chunks, each accounted alone, that merge into one.
BIG_MAPPING = """
import asyncio, ctypes, errno, json, mmap, os, sys
import uvloop
from vlmserve.watchdog import _run_argv

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
meminfo = dict(line.split(":") for line in open("/proc/meminfo"))
total = sum(int(meminfo[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
chunk = (total // 4) // mmap.PAGESIZE * mmap.PAGESIZE
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
base = libc.mmap(None, 6 * chunk, 0, flags, -1, 0)  # PROT_NONE: not accounted yet
for i in range(6):
    if libc.mprotect(base + i * chunk, chunk, mmap.PROT_READ | mmap.PROT_WRITE):
        print(json.dumps({"setup": os.strerror(ctypes.get_errno())}))
        sys.exit()
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    fork = "ok"
except OSError as exc:
    fork = errno.errorcode[exc.errno]
code = uvloop.run(_run_argv([sys.executable, "-c", "pass"], 30, kill_on_cancel=True))
print(json.dumps({"fork": fork, "exit_code": code}))
"""


def test_the_idle_command_starts_where_this_process_cannot_be_forked() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BIG_MAPPING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    if result.get("fork") != "ENOMEM":
        pytest.skip(f"this kernel's overcommit policy lets such a process fork: {result}")
    assert result["exit_code"] == 0
