"""``EngineProcClient``: a chat model whose engine runs in its own process (the default).

vLLM V1's split: the API process does HTTP, media, streaming and the stream store; the engine
process (``core.py``) holds the model, schedules and detokenises. They share no GIL, so the
API's per-event work and the engine's per-step Python run in parallel, and an engine that
crashes (a segfault, the kernel's OOM killer) takes down only its process: the model turns
``failed``, its streams end with a 503, and the model manager reloads it (a fresh process).

Requests go over as ``GenerateRequest`` objects, their images in shared memory blocks
(``pixels.py``: only the blocks' names are pickled; a media worker's block is handed over as
it is); ``prepare`` answers
once the engine process has tokenised and preprocessed one, so input errors are still 4xx
before a stream starts. Chunks come back a decode step at a time; a reader thread hands them to
the consumers' event loops with one ``call_soon_threadsafe`` per loop and step. Admission (the
queue bound, 429) is decided here from the streams that have no output yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import vlmserve
from vlmserve.engine.admission import QueuePlaces
from vlmserve.engine.coalesce import END, coalesced
from vlmserve.engine.proc.pixels import Blocks, shipped
from vlmserve.engine.proc.wire import Ready, Sender, decode_error, read_forever
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import (
    BackendStats,
    Chunk,
    GenerateRequest,
    ModelState,
    Scored,
    ScorePair,
    Serves,
    Tokenized,
)
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.priority import low_priority_executor

__all__ = ["EngineProcClient"]

log = logging.getLogger(__name__)
_STOP_TIMEOUT = 30.0  # seconds an engine process gets to exit after "close"


@dataclass(slots=True, eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    started: bool = False  # a chunk has arrived (no longer waiting for admission)
    ended: bool = False  # END or an error is queued: nothing to cancel


class EngineProcClient(Backend):
    serves = Serves.CHAT

    def __init__(
        self,
        model_id: str,
        factory: Callable[[], Backend],
        media_nice: int = 0,
        *,
        scores: bool = False,
    ):
        """``factory`` (picklable) builds the in-process backend inside the engine process;
        a request's pixels are copied into shared memory ``media_nice`` below the request
        path's priority (``media/workers/priority.py``); ``scores``: the backend also scores
        documents (a chat model with the ``rerank`` role: pairs run in the engine process,
        on its engine and vision cache)."""
        self.model_id = model_id
        self._scores = scores
        self.factory = factory
        self._shipper = low_priority_executor(2, media_nice, "vlmserve-media-ship")
        self.state = ModelState.UNLOADED
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._sender: Sender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boot: asyncio.Future[Ready] | None = None
        self._ready: Ready | None = None
        self._stats = BackendStats()
        self._stats_at = 0.0  # monotonic time the last stats arrived
        self._memory = 0
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._places = QueuePlaces(model_id)  # held by admitted requests not streaming yet
        self._closing = False
        self._on_failure: Callable[[Any], None] | None = None
        self._failures = 0  # engine failures and process deaths, across reloads
        self._last_error: str | None = None

    # --- lifecycle -----------------------------------------------------------------------
    async def aload(self) -> None:
        """Start the engine process and wait until its model is loaded."""
        self.state, self.error, self._closing = ModelState.LOADING, None, False
        self._stats, self._stats_at = BackendStats(), 0.0  # a new process reports afresh
        loop = self._loop = asyncio.get_running_loop()
        self._boot = loop.create_future()
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self._start)
            self._ready = await self._boot
        except BaseException as exc:
            self.state, self.error = ModelState.FAILED, str(exc)
            await asyncio.to_thread(self._stop)
            raise
        self.load_seconds = time.perf_counter() - started
        self._memory = self._ready.memory_bytes
        self.state = ModelState.READY
        log.info(
            "%s: engine process %d ready in %.1f s",
            self.model_id,
            self._proc.pid,
            self.load_seconds,
        )

    def _start(self) -> None:
        """``python -m vlmserve.engine.proc`` on one end of a socket pair: a fresh interpreter
        (no fork of a process with threads, no re-import of the caller's ``__main__``)."""
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "vlmserve.engine.proc", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=_same_package_env(),
            )
        self._conn = Connection(ours.detach())
        level = logging.getLogger("vlmserve").getEffectiveLevel()
        self._sender = Sender(self._conn, f"engine-send-{self.model_id}")
        self._sender.send((self.factory, level))  # what the engine process builds
        threading.Thread(
            target=read_forever,
            args=(self._conn, self._receive),
            daemon=True,
            name=f"engine-read-{self.model_id}",
        ).start()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._closing = True
        self._stop()
        self.state, self._ready = ModelState.UNLOADED, None

    def _stop(self) -> None:
        """Ask the engine process to exit; kill it if it does not."""
        proc, sender = self._proc, self._sender
        if proc is None:
            return
        if sender is not None:
            sender.send(("close",))
            sender.stop()
        try:
            proc.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("%s: engine process %d did not exit; killing it", self.model_id, proc.pid)
            proc.kill()
            proc.wait()
        self._conn.close()
        self._proc = self._sender = None

    # --- generation ----------------------------------------------------------------------
    def admit(self) -> Callable[[], None]:
        limit = self._ready.max_queued if self._ready is not None else 0
        waiting = sum(1 for s in self._streams.values() if not s.started)
        return self._places.admit(waiting, limit or None)

    async def prepare(self, request: GenerateRequest) -> int:
        self.check_ready()
        rid = next(self._ids)
        blocks = Blocks()
        if request.has_media:  # pixels go in shared memory (pixels.py), not the pickle
            request, blocks = await shipped(request, self._shipper)
        try:
            await self._call(rid, ("prepare", rid, request))
        except asyncio.CancelledError:
            self._send(("discard", rid))  # the engine process may have prepared it
            raise
        finally:
            blocks.release()  # read by the engine by now, or never will be
        return rid

    async def discard(self, prepared: Any) -> None:
        self._send(("discard", prepared))

    async def tokenize(
        self, what: GenerateRequest | str, *, add_special_tokens: bool = True
    ) -> Tokenized:
        self.check_ready()
        rid = next(self._ids)
        blocks = Blocks()
        if isinstance(what, GenerateRequest) and what.has_media:
            what, blocks = await shipped(what, self._shipper)
        try:
            result: Tokenized = await self._call(rid, ("tokenize", rid, what, add_special_tokens))
        finally:
            blocks.release()
        return result

    async def detokenize(self, ids: list[int]) -> str:
        self.check_ready()
        rid = next(self._ids)
        return str(await self._call(rid, ("detokenize", rid, ids)))

    @property
    def also_serves(self) -> frozenset[Serves]:
        return frozenset({Serves.RERANK}) if self._scores else frozenset()

    async def score(self, pairs: list[ScorePair]) -> Scored:
        if not self._scores:
            return await super().score(pairs)
        self.check_ready()
        rid = next(self._ids)
        result: Scored = await self._call(rid, ("score", rid, pairs))
        return result

    def generate(self, prepared: Any) -> AsyncIterator[Chunk]:
        return self._chunks(prepared)

    async def _chunks(self, rid: int) -> AsyncIterator[Chunk]:
        if self.state is not ModelState.READY:  # failed since it was prepared
            if self._sender is not None:
                self._sender.send(("discard", rid))
            self.check_ready()
        stream = _Stream(asyncio.get_running_loop())
        self._streams[rid] = stream
        self._send(("generate", rid))
        try:
            async for chunk in coalesced(stream.queue, lambda: len(self._streams) > 1):
                stream.started = True
                yield chunk
        finally:
            self._streams.pop(rid, None)
            if not stream.ended:
                self._send(("cancel", rid))  # stopped at the engine's next step boundary

    async def _call(self, rid: int, message: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._calls[rid] = (loop, future)
        try:
            self._send(message)
            return await future
        finally:
            self._calls.pop(rid, None)

    def _send(self, message: Any) -> None:
        if self._sender is None:
            self.check_ready()
            raise ServiceUnavailable(f"model {self.model_id!r} has no engine process; retry")
        self._sender.send(message)

    # --- from the engine process (reader thread) -----------------------------------------
    def _receive(self, batch: list[Any] | None) -> None:
        if batch is None:
            self._post(self._loop, self._gone)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        for message in batch:
            kind = message[0]
            if kind == "stats":
                self._stats, self._memory = message[1], message[2]
                self._stats_at = time.monotonic()
            elif kind in ("ready", "load_failed", "failed"):
                self._post(self._loop, self._control, message)
            elif (stream := self._streams.get(message[1])) is not None:
                by_loop.setdefault(stream.loop, []).append((stream, _stream_item(message)))
            elif (call := self._calls.get(message[1])) is not None:
                by_loop.setdefault(call[0], []).append((call[1], message))
        for loop, items in by_loop.items():
            self._post(loop, _deliver, items)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., None], *args: Any) -> None:
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: its requests are gone
                loop.call_soon_threadsafe(fn, *args)

    def _control(self, message: Any) -> None:
        kind, boot = message[0], self._boot
        if kind == "ready" and boot is not None and not boot.done():
            boot.set_result(message[1])
        elif kind == "load_failed" and boot is not None and not boot.done():
            boot.set_exception(decode_error(message[1]))
        elif kind == "failed":
            self._failed(str(message[1]))

    def _gone(self) -> None:
        """The engine process closed its end: asked to (unload), or it died."""
        if self._closing:
            self._fail_all(ServiceUnavailable(f"model {self.model_id!r} was unloaded; retry"))
            return
        code = _exit_code(self._proc)
        reason = f"its engine process exited (exit code {code})"
        if self._boot is not None and not self._boot.done():
            self._boot.set_exception(
                ServiceUnavailable(f"model {self.model_id!r}: {reason} while loading")
            )
            return
        # Stopped on purpose (a signal that asks, before the engine set its handlers) is
        # news; a crash (a segfault, the OOM killer's SIGKILL, an exception) is an error.
        stopped = code is not None and -code in (signal.SIGTERM, signal.SIGINT)
        log.log(logging.INFO if stopped else logging.ERROR, "%s: %s", self.model_id, reason)
        self._failed(reason)

    def _failed(self, reason: str) -> None:
        """The model cannot serve until reloaded: its streams end with a 503 and the model
        manager is told (it reloads the model: a new engine process)."""
        if self.state is not ModelState.READY:
            return
        self._failures += 1
        self._last_error = reason
        self.state, self.error = ModelState.FAILED, f"engine failed: {reason}"
        self._fail_all(
            ServiceUnavailable(
                f"model {self.model_id!r} stopped: {reason}; it is being reloaded, retry in a "
                "few seconds",
                retry_after=10,
                code="engine_failed",
            )
        )
        if self._on_failure is not None:
            self._on_failure(self._loop)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._post(stream.loop, _deliver, [(stream, exc)])
        for loop, future in list(self._calls.values()):
            self._post(loop, _deliver, [(future, ("error", None, exc))])

    # --- observation ---------------------------------------------------------------------
    def watch_failures(self, callback: Callable[[Any], None]) -> None:
        self._on_failure = callback

    def check_progress(self, timeout: float) -> bool:
        """The engine process reports how long its engine has been stuck (``stats``, twice a
        second); reports that stop coming while streams wait count as stuck time too. A
        stuck engine process is killed: the model fails and is reloaded (a fresh process)."""
        if timeout <= 0 or self.state is not ModelState.READY or not self._stats_at:
            return False
        age = time.monotonic() - self._stats_at
        stats = self._stats
        stalled = stats.stalled_seconds + age if stats.stalled_seconds else 0.0
        if not stalled and (self._streams or self._calls):
            stalled = age  # the engine process stopped reporting while requests wait on it
        if stalled <= max(timeout, 3 * stats.longest_step_seconds):
            return False
        proc = self._proc
        self._failed(f"no progress for {stalled:.1f} s with requests pending (liveness timeout)")
        if proc is not None:
            proc.kill()
        return True

    def capabilities(self) -> frozenset[str] | None:
        ready = self._ready if self.state is ModelState.READY else None
        return ready.capabilities if ready is not None else None

    def video_sampling(self) -> Any:
        ready = self._ready if self.state is ModelState.READY else None
        return ready.video_sampling if ready is not None else None

    @property
    def memory_bytes(self) -> int:
        return self._memory if self.state is ModelState.READY else 0

    def stats(self) -> BackendStats:
        return replace(
            self._stats, engine_failures=self._failures, last_engine_error=self._last_error
        )

    def describe(self) -> dict[str, Any]:
        proc = self._proc
        return {"engine_process": {"pid": proc.pid if proc is not None else None}}


def _same_package_env() -> dict[str, str]:
    """The environment with this process's ``vlmserve`` first on the path: the engine process
    runs the very code the API process runs (a source checkout, another install)."""
    root = str(Path(vlmserve.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _exit_code(proc: subprocess.Popen[bytes] | None) -> int | None:
    if proc is None:
        return None
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(1.0)
    return None


def _stream_item(message: Any) -> Any:
    kind = message[0]
    if kind == "chunk":
        return message[2]
    return END if kind == "end" else decode_error(message[2])


def _deliver(items: list[tuple[Any, Any]]) -> None:
    """On a consumer's loop: chunks to their streams, answers to their calls."""
    for target, item in items:
        if isinstance(target, _Stream):
            target.ended = target.ended or item is END or isinstance(item, BaseException)
            target.queue.put_nowait(item)
        elif not target.done():
            kind, _, value = item
            if kind == "error":
                error = value if isinstance(value, BaseException) else decode_error(value)
                target.set_exception(error)
            else:
                target.set_result(value)
