"""The engine process: one model's in-process backend (``engine/hf``) served over a connection.

Started by ``EngineProcClient`` (``client.py``) as ``python -m vlmserve.engine.proc FD``. Its
event loop runs the backend exactly as the API process would (``prepare``, ``generate``), so
batching, grammars, stop strings and the caches behave the same; what it sends back is the
chunks, one list per loop turn (a decode step's chunks of every stream in one send), and the
backend's stats twice a second.

A request starts generating as soon as it is prepared: its chunks are held here until the API
process asks for them (``generate``), so the prepare's answer on its way back and ``generate``
on its way in overlap the request's queueing and prefill instead of preceding them (on a busy
2-core CPU each of those hops waits for a core); ``discard`` or ``cancel`` stops it.

It exits when the API process says ``close`` or goes away (end of file on the connection), and
ignores Ctrl-C and SIGTERM: the API process decides when it stops. A stop of the whole service
(SIGTERM to every process of its group or cgroup, as systemd and ``timeout`` send) thus lets
the API process finish its streams, then close the engine; SIGKILL stops an engine process
alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from vlmserve import heap
from vlmserve.engine.proc.pixels import receive
from vlmserve.engine.proc.wire import Ready, encode_error, read_forever
from vlmserve.engine.protocol import Backend
from vlmserve.media.workers.priority import low_priority_executor

__all__ = ["EngineCore", "run"]

log = logging.getLogger(__name__)
STATS_EVERY = 0.5  # seconds between the stats the API process shows in /metrics
SWITCH_INTERVAL = 0.001  # seconds a thread holds the GIL while another waits for it


def run(conn: Connection) -> None:
    """The engine process's entry point: the first message says what to build."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until serve() says so in the log
    # As in the API process (cli/serve.py): the model thread, the loop and the processor
    # threads share the GIL, and at the default 5 ms the model thread or the loop could wait
    # that long after each torch call while a processor thread patchifies a photo.
    sys.setswitchinterval(SWITCH_INTERVAL)
    factory, log_level = conn.recv()
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s"
    )
    asyncio.run(EngineCore(conn, factory).serve())


class EngineCore:
    def __init__(self, conn: Connection, factory: Callable[[], Backend]):
        self.conn = conn
        self.factory = factory
        self.backend: Backend | None = None
        self.prepared: dict[int, Any] = {}  # rid -> what backend.prepare returned
        self.preparing: dict[int, asyncio.Task[None]] = {}  # rid -> its prepare, until done
        self.tasks: dict[int, asyncio.Task[None]] = {}  # rid -> its generate task
        self.held: dict[int, list[Any]] = {}  # rid -> its chunks, until the API asks for them
        self.outbox: list[Any] = []
        self.closing = asyncio.Event()
        self.receiver: ThreadPoolExecutor | None = None  # media_nice threads: pixels read in

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.add_signal_handler(signal.SIGTERM, self._sigterm)
        backend = self.factory()
        try:
            await backend.aload()
        except Exception as exc:
            self.conn.send([("load_failed", encode_error(exc))])
            return
        self.backend = backend
        heap.settle()  # the model too: it lives as long as this process (heap.py)
        nice = getattr(getattr(backend, "config", None), "media_nice", 0)
        self.receiver = low_priority_executor(2, nice, "vlmserve-media-receive")
        backend.watch_failures(lambda _: self.loop.call_soon_threadsafe(self._failed))
        config = getattr(backend, "config", None)
        ready = Ready(
            backend.capabilities(),
            backend.memory_bytes,
            backend.load_seconds,
            int(getattr(config, "max_queued", 0)),
            backend.video_sampling(),
        )
        self.conn.send([("ready", ready)])
        reader = threading.Thread(
            target=read_forever, args=(self.conn, self._receive), name="engine-reader", daemon=True
        )
        reader.start()
        stats = self.loop.create_task(self._stats())
        await self.closing.wait()
        for task in [stats, *self.tasks.values()]:
            task.cancel()
        await backend.aclose()

    def _receive(self, message: Any) -> None:
        """On the reader thread."""
        self.loop.call_soon_threadsafe(self._handle, message)

    def _handle(self, message: Any) -> None:
        kind = "close" if message is None else message[0]
        if kind == "close":
            self.closing.set()
        elif kind == "prepare":
            self.preparing[message[1]] = self.loop.create_task(
                self._prepare(message[1], message[2])
            )
        elif kind == "generate":
            self._release(message[1])
        elif kind == "cancel":
            self._cancel(message[1])
        elif kind == "discard":
            self._spawn(message[1], self._discard(message[1]))
        elif kind == "tokenize":
            self._spawn(message[1], self._tokenize(message[2], message[3]))
        elif kind == "detokenize":
            self._spawn(message[1], self._detokenize(message[2]))
        elif kind == "score":
            assert self.backend is not None
            self._spawn(message[1], self.backend.score(message[2]))

    def _spawn(self, rid: int, work: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        """Run ``work``; its result (or error) goes back as ``done`` (or ``error``)."""

        async def answer() -> None:
            try:
                result = await work
            except Exception as exc:
                self._emit(("error", rid, encode_error(exc)))
            else:
                self._emit(("done", rid, result))

        return self.loop.create_task(answer())

    async def _prepare(self, rid: int, request: Any) -> None:
        """Prepare ``rid``, answer (sent now, ahead of the model's work), then start it."""
        assert self.backend is not None
        try:
            if request.has_media:  # out of the API process's shared blocks (pixels.py)
                request = await self.loop.run_in_executor(self.receiver, receive, request)
            self.prepared[rid] = await self.backend.prepare(request)
        except Exception as exc:
            self._emit(("error", rid, encode_error(exc)))
            return
        finally:
            self.preparing.pop(rid, None)
        self._emit(("done", rid, None))
        self._flush()
        self.held[rid] = []
        self.tasks[rid] = self.loop.create_task(self._generate(rid))

    def _release(self, rid: int) -> None:
        """The API process reads ``rid``'s chunks now: those held go out, the rest as they
        come. A rid with nothing held (its prepare failed) gets an error, as it would have
        from a generate that found nothing prepared."""
        held = self.held.pop(rid, None)
        if held is None:
            self._emit(("error", rid, encode_error(KeyError(f"request {rid} is not prepared"))))
            return
        for message in held:
            self._emit(message)

    async def _tokenize(self, what: Any, add_special_tokens: bool) -> Any:
        assert self.backend is not None
        if not isinstance(what, str) and what.has_media:
            what = await self.loop.run_in_executor(self.receiver, receive, what)
        return await self.backend.tokenize(what, add_special_tokens=add_special_tokens)

    async def _detokenize(self, ids: list[int]) -> str:
        assert self.backend is not None
        return await self.backend.detokenize(ids)

    async def _discard(self, rid: int) -> None:
        """``rid``'s prepared request dropped (after its prepare, if that still runs: the API
        process gave up waiting for it)."""
        pending = self.preparing.get(rid)
        if pending is not None:
            await asyncio.wait([pending])
        self._stop(rid)  # one cancelled before its first step is still prepared: below
        prepared = self.prepared.pop(rid, None)
        if prepared is not None and self.backend is not None:
            await self.backend.discard(prepared)

    async def _generate(self, rid: int) -> None:
        assert self.backend is not None
        prepared = self.prepared.pop(rid)
        try:
            async for chunk in self.backend.generate(prepared):
                self._answer(rid, ("chunk", rid, chunk))
        except asyncio.CancelledError:
            return  # the API process cancelled it and expects nothing more
        except Exception as exc:
            self._answer(rid, ("error", rid, encode_error(exc)))
        else:
            self._answer(rid, ("end", rid))
        finally:
            self.tasks.pop(rid, None)

    def _answer(self, rid: int, message: Any) -> None:
        """A message of ``rid``'s stream: held while the API process has not asked for it."""
        held = self.held.get(rid)
        if held is not None:
            held.append(message)
        else:
            self._emit(message)

    def _stop(self, rid: int) -> None:
        """Stop ``rid``'s generation (the backend drops it when its task is cancelled); what
        it had made and the API process had not asked for is dropped."""
        self.held.pop(rid, None)
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()  # before it started, too: then its request is still prepared

    def _cancel(self, rid: int) -> None:
        self._stop(rid)
        if rid in self.prepared:
            self._spawn(rid, self._discard(rid))

    def _emit(self, message: Any) -> None:
        """Queue ``message``; everything queued in this loop turn goes in one send."""
        self.outbox.append(message)
        if len(self.outbox) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        batch, self.outbox = self.outbox, []
        if not batch:  # sent already, ahead of its turn (a prepare's answer)
            return
        try:
            self.conn.send(batch)
        except (OSError, ValueError):  # the API process is gone
            self.closing.set()

    async def _stats(self) -> None:
        assert self.backend is not None
        while True:
            stats = self.backend.stats()
            stats.process_rss_bytes = resident_bytes()
            self._emit(("stats", stats, self.backend.memory_bytes))
            await asyncio.sleep(STATS_EVERY)

    def _sigterm(self) -> None:
        log.info("SIGTERM: this engine process exits when its server closes it (SIGKILL: now)")

    def _failed(self) -> None:
        error = self.backend.error if self.backend is not None else None
        log.error("engine failed: %s", error)
        self._emit(("failed", error or "engine failed"))


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
