"""Media work at a lower OS priority than the request path, per thread.

On a machine whose cores an image flood keeps busy, a text request's way through the server
is a chain of thread wake-ups (event loop, engine reader, engine loop, model thread). Each
one that finds both cores taken by media work (decode, copies into and out of shared memory,
the image processor) waits for the scheduler; at the same priority that is a few milliseconds a
hop. Linux keeps the nice value per thread, so the threads that only do media work can be
made to yield to the others while the process's other threads keep their priority: a
media worker process (``os.nice`` in its initializer), the API process's threads that copy
pixels decoded in this process into shared memory, and the engine process's threads that
read them and run the processor on requests with media. Raising one's own nice value needs
no privilege; lowering it does, so these threads do media work only, for their whole life.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["low_priority_executor", "lower_this_thread", "thread_nice"]

MAX_NICE = 19


def thread_nice() -> int:
    """The calling thread's nice value (its own, not the process's main thread's; the
    process's where the system keeps one per process)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return os.getpriority(os.PRIO_PROCESS, 0)


def lower_this_thread(nice: int) -> int:
    """Add ``nice`` to the calling thread's nice value (at most 19); -> the value it has.
    Where the system refuses (no per-thread priorities), the thread keeps its priority."""
    if nice <= 0:
        return thread_nice()
    with contextlib.suppress(OSError, AttributeError):
        target = min(MAX_NICE, thread_nice() + nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    return thread_nice()


def _start_thread(nice: int, then: Callable[[], object] | None) -> None:
    lower_this_thread(nice)
    if then is not None:
        then()


def low_priority_executor(
    workers: int, nice: int, name: str, initializer: Callable[[], object] | None = None
) -> ThreadPoolExecutor:
    """Threads that run at ``nice`` below their creator; ``initializer`` runs after that."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=_start_thread, initargs=(nice, initializer)
    )
