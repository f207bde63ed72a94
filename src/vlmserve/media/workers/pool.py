"""Media work in worker processes: ``await pool.run(fn, *args)`` runs ``fn`` in one of them.

Fetching, decoding (Pillow, PyAV) and sampling hold the GIL for tens of milliseconds per
photo; in the API process they would delay every other request's next event. Here they run
in ``workers`` spawned processes (a lower OS priority than the request path, ``nice``), and
the call site keeps its function and arguments: what a decode is called with is unchanged.

Results come back with their images in shared memory (``shared.py``) and stay there: the
API process gets ``BlockImage``s naming the blocks, which an engine in its own process reads
directly; nothing is copied on the event loop (a photo's 3.7 MB copied out and in again was a
third of the loop's busy time under an image flood, measured). A worker that dies
(``kill -9``, the OOM killer, a crashing decoder) breaks the executor: every call in flight on
it is retried once on a fresh set of workers, and a call whose retry also loses its worker is
a 503 that says so. Requests without media never touch the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.memory import WORKER, set_malloc_policy
from vlmserve.media.workers.shared import held, release, to_shared

__all__ = ["MediaPool", "default_workers"]

T = TypeVar("T")
ATTEMPTS = 2  # a call is tried again once after its worker died


def default_workers(cpus: int | None = None) -> int:
    """Half the cores, at least one, at most four: the rest serve requests and the engine."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(4, cpus // 2))


def _start_worker(nice: int) -> None:
    # Ctrl-C reaches the whole process group: the server stops its workers itself, and a
    # worker that died of it mid-decode would only be replaced while the server stops. And
    # with SIGINT left alone, every ``asyncio.run`` (``read_and_decode``) installs its own
    # handler and on Python 3.11 checks it back by formatting the finished task, result
    # included: 24 ms for the bytes of a 1.5 MB video.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_malloc_policy(WORKER)  # one item at a time: its heap may keep its buffers
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    if nice > 0:
        with contextlib.suppress(OSError):  # not permitted here: the same priority
            os.nice(nice)


def _exit_with(parent: int) -> None:
    """A worker outlives no server: killed with ``kill -9``, the server cannot stop it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs in the worker: the call, its images moved into shared memory."""
    return to_shared(fn(*args, **kwargs))


def _discard(future: Future[Any]) -> None:
    """Free the shared blocks of a result nobody waits for any more."""
    if not future.cancelled() and future.exception() is None:
        release(future.result())


def _ready() -> int:
    import vlmserve.media  # noqa: F401 - import Pillow and PyAV before the first request

    return os.getpid()


class MediaPool:
    """``workers`` processes (spawned on first use or ``start``), replaced when one dies."""

    def __init__(self, workers: int, *, nice: int = 5):
        if workers < 1:
            raise ValueError("a media pool needs at least one worker")
        self.workers, self.nice = workers, nice
        self.in_flight = 0  # calls submitted and not yet answered (queued or running)
        self.replaced = 0  # times the workers were replaced after one died
        self._executor: ProcessPoolExecutor | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False

    def _current(self) -> tuple[ProcessPoolExecutor, int]:
        with self._lock:
            if self._closed:
                raise ServiceUnavailable("the server is shutting down", code="shutting_down")
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(self.nice,),
                )
                # Every worker now: a spawn-context pool starts a process only for a task
                # that finds none idle and counts each finished task as an idle process, so
                # a replaced pool under one call at a time would stay at one process.
                for _ in range(self.workers):
                    self._executor.submit(_ready)
            return self._executor, self._generation

    def _replace(self, generation: int) -> None:
        """Drop a broken executor (once, whoever notices first); the next call starts anew."""
        with self._lock:
            if generation != self._generation or self._executor is None:
                return
            broken, self._executor = self._executor, None
            self._generation += 1
            self.replaced += 1
        broken.shutdown(wait=False, cancel_futures=True)

    async def start(self) -> list[int]:
        """Start every worker and import the decoders in it; their process ids."""
        executor, _ = self._current()
        futures = [asyncio.wrap_future(executor.submit(_ready)) for _ in range(self.workers)]
        return list(await asyncio.gather(*futures))

    def pids(self) -> list[int]:
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return sorted(processes)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker; ``fn`` and its arguments must pickle."""
        self.in_flight += 1
        try:
            for _ in range(ATTEMPTS):
                executor, generation = self._current()
                try:
                    future = executor.submit(_call, fn, args, kwargs)
                    shared = await asyncio.wrap_future(future)
                except BrokenProcessPool:
                    self._replace(generation)
                    continue
                except asyncio.CancelledError:  # a timeout or a client gone: the call may
                    future.add_done_callback(_discard)  # still finish, its blocks are freed
                    raise
                result: T = held(shared)  # the blocks are the images' from here on
                return result
        finally:
            self.in_flight -= 1
        raise ServiceUnavailable(
            "a media worker process died while decoding this request's media, twice; the "
            "workers were restarted: retry the request, and if it fails again its media are "
            "likely what crashes the decoder",
            retry_after=1.0,
            code="media_worker_died",
        )

    def close(self, *, grace: float = 2.0) -> None:
        """Stop the workers: none outlives the server, whatever it was decoding.

        Calls still queued are cancelled; a worker still decoding gets ``grace`` seconds
        after SIGTERM, then SIGKILL. Shared blocks it leaves are unlinked by the resource
        tracker, which exits with the server.
        """
        with self._lock:
            self._closed, executor, self._executor = True, self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + grace
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)
