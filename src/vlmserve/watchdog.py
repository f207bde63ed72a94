"""Idle watchdog: a process-wide activity clock, and a task that acts once when idle.

A GPU box that shuts itself down after 480 s without activity, and never tells the instance
registry, leaves callers addressing a stopped host. Here the order is fixed:

1. ``ActivityClock`` is touched on every request, streamed token and model load; ``busy()``
   (or ``begin``/``end``) marks work in flight. Its time is also written, at most once a second
   and atomically, to an optional activity file for outside tools.
2. ``IdleWatchdog`` checks every ``check_interval`` seconds. When the clock has been idle for
   ``idle_seconds`` with nothing in flight it FIRST calls the deregistration hook (HTTP POST or
   argv), THEN waits until nothing is in flight, THEN runs ``idle_command`` exactly once, then
   stops. A hook that fails or times out is logged and does NOT block the command: a host that
   cannot deregister still shuts down (the callers' fallback then applies, as before).

Commands are argv lists run with ``subprocess.Popen``: never through a shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from vlmserve.errors import ConfigError

__all__ = [
    "ActivityClock",
    "ActivityMiddleware",
    "CommandDeregisterHook",
    "DeregisterHook",
    "HttpDeregisterHook",
    "IdleWatchdog",
    "validate_argv",
]

log = logging.getLogger(__name__)
SPAWN_TRIES = 4  # starts of the idle command refused by the kernel (ENOMEM, EAGAIN)
SPAWN_BACKOFF = 2.0  # seconds before the first retry, then 4, 6
WAIT_POLL = 0.05  # seconds between checks whether a command has exited


def validate_argv(value: object, setting: str) -> list[str]:
    """A non-empty list of non-empty strings, or ConfigError saying how to write it."""
    if isinstance(value, str | bytes):
        raise ConfigError(
            f"{setting} is a string ({value!r}); give an argv list such as "
            '["sudo", "shutdown", "-h", "now"]: it is never run through a shell'
        )
    if not isinstance(value, Sequence) or not value:
        raise ConfigError(f'{setting} must be a non-empty argv list such as ["/usr/bin/true"]')
    if not all(isinstance(part, str) and part for part in value):
        raise ConfigError(f"{setting} must contain only non-empty strings; got {value!r}")
    return list(value)


class ActivityClock:
    """When anything last happened, and how much is happening now. Safe across threads."""

    def __init__(
        self,
        activity_file: str | Path | None = None,
        *,
        write_interval: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.activity_file = Path(activity_file) if activity_file else None
        self._write_interval = write_interval
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = monotonic()
        self._last_write: float | None = None
        self._write_failed = False
        self.touch()  # outside tools see a live process from the start

    @property
    def in_flight(self) -> int:
        return self._in_flight  # one int read: atomic

    def touch(self) -> None:
        now = self._monotonic()
        with self._lock:
            self._last = now
            due = self.activity_file is not None and (
                self._last_write is None or now - self._last_write >= self._write_interval
            )
            if due:
                self._last_write = now
        if due and self.activity_file is not None:
            self._write_file(self.activity_file)

    def begin(self) -> None:
        with self._lock:
            self._in_flight += 1
        self.touch()

    def end(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                log.warning("ActivityClock.end() without begin(); ignored")
            self._in_flight = max(0, self._in_flight - 1)
        self.touch()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def idle_for(self) -> float:
        """Seconds since the last touch (in-flight work is reported by ``in_flight``)."""
        with self._lock:
            return max(0.0, self._monotonic() - self._last)

    def _write_file(self, target: Path) -> None:
        """Write the wall-clock time atomically (temp file + rename); never raise."""
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            try:
                os.fchmod(fd, 0o644)  # readable by outside tools, like a plain file
                with os.fdopen(fd, "w") as f:
                    f.write(f"{time.time():.3f}\n")
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            if not self._write_failed:  # once, not once a second
                log.warning("cannot write activity file %s: %s", target, exc)
            self._write_failed = True


class DeregisterHook(Protocol):
    """Tells the instance registry this host is going away; raises on failure."""

    async def __call__(self) -> None: ...


class HttpDeregisterHook:
    """POST ``{"instance": ..., "reason": "idle"}`` to ``url``; a non-2xx status is a failure."""

    def __init__(
        self,
        url: str,
        *,
        instance: str | None = None,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"deregistration URL must be http(s)://...; got {url!r}")
        self.url = url
        self.instance = instance or socket.gethostname()
        self.timeout = timeout
        self.headers = headers or {}
        self._transport = transport

    async def __call__(self) -> None:
        body = {"instance": self.instance, "reason": "idle"}
        async with httpx.AsyncClient(timeout=self.timeout, transport=self._transport) as client:
            response = await client.post(self.url, json=body, headers=self.headers)
            response.raise_for_status()


class CommandDeregisterHook:
    """Run an argv (no shell); a non-zero exit status or a timeout is a failure."""

    def __init__(self, argv: Sequence[str], *, timeout: float = 30.0):
        self.argv = validate_argv(argv, "deregistration command")
        self.timeout = timeout

    async def __call__(self) -> None:
        code = await _run_argv(self.argv, self.timeout, kill_on_cancel=True)
        if code != 0:
            raise RuntimeError(f"{self.argv[0]} exited with status {code}")


async def _run_argv(argv: Sequence[str], timeout: float | None, *, kill_on_cancel: bool) -> int:
    """Run argv without a shell and return its exit status; kill it after ``timeout``.

    On cancellation the process is killed only if ``kill_on_cancel``: an idle command such as
    a shutdown must not be killed because the server it is stopping is going down.

    Started with ``subprocess.Popen`` (vfork), not the event loop's spawn: uvloop's forks
    this whole process, and a fork must account for every writable mapping it holds (a
    model's KV cache). A server whose mappings outgrow RAM could then not start its idle
    command at all (ENOMEM).
    """
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while (code := process.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(WAIT_POLL)
        return code
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        if kill_on_cancel or not isinstance(exc, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.to_thread(process.wait)
        raise


class IdleWatchdog:
    """After ``idle_seconds`` of quiet: deregister, then run ``idle_command`` once, then stop."""

    def __init__(
        self,
        clock: ActivityClock,
        *,
        idle_seconds: float,
        check_interval: float = 30.0,
        idle_command: Sequence[str] | None = None,
        deregister: DeregisterHook | None = None,
        hook_timeout: float = 30.0,
        command_timeout: float | None = None,
    ):
        if idle_seconds <= 0 or check_interval <= 0:
            raise ConfigError(
                "VLMSERVE_IDLE_SECONDS and VLMSERVE_IDLE_CHECK_INTERVAL must be > 0 seconds "
                "(leave VLMSERVE_IDLE_SECONDS unset to turn the idle watchdog off)"
            )
        self.clock = clock
        self.idle_seconds = idle_seconds
        self.check_interval = check_interval
        self.idle_command = (
            None if idle_command is None else validate_argv(idle_command, "idle_command")
        )
        self.deregister = deregister
        self.hook_timeout = hook_timeout
        self.command_timeout = command_timeout
        self.fired = False
        self.exit_code: int | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start checking (call from the running event loop, e.g. the app's lifespan)."""
        if self._task is None and not self.fired:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="idle-watchdog")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.check_interval)
                if self.clock.in_flight:
                    self.clock.touch()  # keeps the activity file fresh during loads and streams
                    continue
                if self.clock.idle_for() >= self.idle_seconds:
                    await self._fire()
                    return
        except Exception:
            log.exception("idle watchdog stopped by an unexpected error")

    async def _fire(self) -> None:
        self.fired = True
        log.warning("idle for %.0f s with nothing in flight", self.clock.idle_for())
        if self.deregister is not None:
            await self._call_hook(self.deregister)
        while self.clock.in_flight:  # work that arrived while we deregistered finishes first
            await asyncio.sleep(self.check_interval)
        if self.idle_command is not None:
            await self._run_command(self.idle_command)

    async def _call_hook(self, hook: DeregisterHook) -> None:
        try:
            await asyncio.wait_for(hook(), self.hook_timeout)
            log.info("deregistered this instance before the idle command")
        except Exception as exc:  # logged, never blocks the idle command
            log.error(
                "deregistration hook failed (%s: %s); running the idle command anyway",
                type(exc).__name__,
                exc,
            )

    async def _run_command(self, argv: list[str]) -> None:
        log.warning("running idle command %s", argv)
        for attempt in range(1, SPAWN_TRIES + 1):
            try:
                self.exit_code = await _run_argv(argv, self.command_timeout, kill_on_cancel=False)
                break
            except Exception as exc:
                # The kernel could not start it for now (no memory, too many processes): a
                # box left running idle costs more than a retry; anything else is final.
                transient = isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EAGAIN)
                if not transient or attempt == SPAWN_TRIES:
                    log.error("idle command %s failed: %s: %s", argv, type(exc).__name__, exc)
                    return
                log.warning("idle command %s could not start (%s); retrying", argv, exc)
                await asyncio.sleep(SPAWN_BACKOFF * attempt)
        log.warning("idle command %s exited with status %s", argv, self.exit_code)


class ActivityMiddleware:
    """Pure ASGI: every HTTP request is in flight on ``clock`` while it runs (streaming too).

    Probes and scrapes (``ignore_paths``) are not activity: a Prometheus scrape every 15 s must
    not keep an idle GPU box alive forever.
    """

    def __init__(
        self,
        app: Any,
        clock: ActivityClock,
        ignore_paths: Sequence[str] = ("/health", "/ready", "/metrics"),
    ):
        self.app = app
        self.clock = clock
        self.ignore_paths = frozenset(ignore_paths)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.ignore_paths:
            await self.app(scope, receive, send)
            return
        with self.clock.busy():
            await self.app(scope, receive, send)
