"""Which threads get torch's intra-op thread team: each model's own thread, and no other.

torch's CPU kernels run on an OpenMP team that belongs to the thread that calls them: every
Python thread that runs a large enough op gets a team of its own (``torch.get_num_threads()``
threads), and the team's workers live as long as that thread. GNU OpenMP (the runtime torch
ships on Linux) lets a team's workers spin between parallel regions only while it manages no
more threads than there are CPUs; past that it puts them to sleep after ~100 spins, and every
op then pays a futex wake-up per worker.

That is what a server did with a team on the thread that loaded the model, another on the
model's thread and one per processor thread: measured on a 2-core CPU, the medium checkpoint's
batch-1 decode step made 114 voluntary context switches (0-1 with one team) and took 10 ms
longer (39 vs 28 ms, in the server against the runner alone). So:

- a model loads and runs on its own thread (``model_executor``), with the process's default
  thread count (``OMP_NUM_THREADS``, else the physical cores);
- everything else torch does on worker threads (the processor, grammar compilation) runs on
  ``prep_executor``'s threads, pinned to one intra-op thread: no team;
- the processor on a request with images or video runs on ``media_executor``'s threads,
  also pinned to one, at a lower OS priority (``media/workers/priority.py``): resizing and
  patchifying a photo takes tens of milliseconds of a core, and on a 2-core CPU under an image
  flood that work would otherwise take the cores a text request's next hop needs.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from vlmserve.media.workers.priority import low_priority_executor

__all__ = [
    "DEFAULT_THREADS",
    "SMALL_MODEL_PARAMS",
    "media_executor",
    "model_executor",
    "model_threads",
    "off_loop",
    "pin",
    "prep_executor",
]

_T = TypeVar("_T")
DEFAULT_THREADS = torch.get_num_threads()  # before anything here changes torch's setting
_PREP_WORKERS = min(8, (os.cpu_count() or 1) + 4)  # as asyncio's default executor
_prep: ThreadPoolExecutor | None = None
_media: dict[int, ThreadPoolExecutor] = {}  # by how much lower their priority is
SMALL_MODEL_PARAMS = 50_000_000  # below this a CPU model's matmuls take microseconds


def pin(threads: int) -> None:
    """Give the calling thread ``threads`` intra-op threads (1: no team of its own).

    torch reads its process-wide number into a thread at that thread's first parallel op;
    asking for it first makes that happen now, so the number set here stays this thread's
    whatever another thread sets later."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def model_threads(model: Any, device: torch.device) -> int:
    """A model's intra-op threads: one for a small model on CPU (fork/join of a team costs
    more than such matmuls save, and its team would throttle a larger model's: a tiny
    embedder that served one request put the medium chat model's decode at 112 context
    switches per token, 26 -> 37 ms), else the default."""
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        return 1
    return DEFAULT_THREADS


def model_executor(name: str, threads: int = 0) -> ThreadPoolExecutor:
    """One model's thread: its load, its steps, its team (``threads``; 0: the default)."""
    return ThreadPoolExecutor(
        1, thread_name_prefix=name, initializer=pin, initargs=(threads or DEFAULT_THREADS,)
    )


def prep_executor() -> ThreadPoolExecutor:
    """The shared threads for torch work beside the models (one intra-op thread each)."""
    global _prep
    if _prep is None:
        _prep = ThreadPoolExecutor(
            _PREP_WORKERS, thread_name_prefix="vlmserve-prep", initializer=pin, initargs=(1,)
        )
    return _prep


def media_executor(nice: int) -> ThreadPoolExecutor:
    """Threads like ``prep_executor``'s, ``nice`` below the process's priority: the processor
    on requests with media."""
    executor = _media.get(nice)
    if executor is None:
        executor = _media[nice] = low_priority_executor(
            _PREP_WORKERS, nice, "vlmserve-media-prep", functools.partial(pin, 1)
        )
    return executor


async def off_loop(
    fn: Callable[..., _T], *args: Any, executor: ThreadPoolExecutor | None = None
) -> _T:
    """``asyncio.to_thread`` on ``executor`` (default ``prep_executor``), the caller's context
    variables too."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor or prep_executor(), call)
