"""Images preprocessed in worker processes of the engine process, read from their blocks.

In an engine process, a request's image is a ``LentImage``: the API process's shared block,
named but not read (``engine/proc/pixels.py``). The image processor's work on a photo
(reading it, resizing, normalising, patchifying) is mostly Python and numpy/torch calls that
hold the GIL, and the engine process's request path (the loop, the model thread, a text
request's template) needs that GIL too. A lower OS priority on the threads that do it does
not help there: a low-priority thread that holds the GIL while a busy CPU keeps it waiting
makes every other thread of the process wait with it. Measured on 2 cores, two low-priority
threads burning CPU in the engine process put a text request's time to first token at 16x
when they held the GIL, and changed it by nothing measurable when they did not.

So, with ``--media-workers N`` (N > 0) and the engine in its own process, a miss of the
processor cache (``processor_cache.py``) on such an image goes to one of N spawned worker
processes below the media threads' priority: it reads the block, runs a copy of the
model's image processor on it and returns the patch rows (in a block of shared memory that
the engine process maps: no copy) and the grid. The output is the same bytes the engine
process would have made (the same processor, one torch thread each). The workers start at
the model's first image (each is a process with torch loaded: seconds, and hundreds of MiB,
that a server without images never pays) and take images once they are up; until then, and
after a worker dies (its image is then preprocessed in the engine process, the pool
restarted), images are preprocessed in the engine process as before.
Only processors whose output is per-image patch rows plus a grid (the processor cache's
layout: Qwen2-VL's family) go there.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import torch

from vlmserve.engine.hf.processor_cache import block_call
from vlmserve.errors import ServiceUnavailable
from vlmserve.media.workers.shared import SharedImage, take_block, write_bytes

__all__ = ["PreprocessPool"]

log = logging.getLogger("vlmserve.engine")

_KEYS = {"pixel_values", "image_grid_thw"}
_GONE = "gone"
_inner: Any = None  # the worker's copy of the image processor


class PreprocessPool:
    """``workers`` processes twice ``nice`` below the engine (below its media threads too;
    at the default 10, nice 19), each with ``inner`` (the model's image processor, pickled);
    ``CachedImageProcessor.remote``.

    The executor's own threads (its manager, its call queue's feeder) pickle and unpickle
    under the GIL, and a thread takes the OS priority of the thread that starts it. Started
    by the first image's media thread they would run ``nice`` below the engine, and on a
    busy CPU one could be kept off it while it holds the GIL, every thread of the engine
    process waiting with it. So they are started by a thread of this pool's own, made with
    the pool (at the engine's priority) and woken by the first image."""

    def __init__(self, inner: Any, workers: int, nice: int):
        self._blob = pickle.dumps(inner)
        self.workers, self.nice = workers, nice
        self._executor: ProcessPoolExecutor | None = None
        self._ready = False
        self._lock = threading.Lock()
        self._closed = False
        self._asked = threading.Event()  # start (or restart) the workers
        self.done = 0  # images preprocessed in the workers
        self.restarts = 0  # pools replaced after a worker died
        threading.Thread(
            target=self._starter, name="vlmserve-preprocess-start", daemon=True
        ).start()

    def start(self) -> None:
        """Spawn the workers; they take images once each has loaded (in the background).
        Called by the first image: a server that never sees one never starts them."""
        self._asked.set()

    def _starter(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            with self._lock:
                if self._closed:
                    return
                if self._executor is not None:
                    continue
                try:
                    executor = ProcessPoolExecutor(
                        self.workers,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_init,
                        initargs=(self._blob, min(19, 2 * self.nice), os.getpid()),
                    )
                except Exception as exc:  # the next image asks again
                    log.warning("image preprocessing workers could not be made: %s", exc)
                    continue
                self._executor, self._ready = executor, False
            self._warm(executor)

    def _warm(self, executor: ProcessPoolExecutor) -> None:
        began = time.perf_counter()
        try:
            # All submitted before any is done: a spawn-context pool starts a process only
            # for a task that finds none idle, and counts each finished task as an idle
            # process, so tasks awaited one by one would leave it at one process for good.
            calls = [executor.submit(os.getpid) for _ in range(self.workers)]
            pids = [call.result() for call in calls]
        except Exception as exc:  # a worker that cannot start: images stay in this process
            log.warning(
                "image preprocessing workers failed to start (%s); images are "
                "preprocessed in the engine process",
                exc,
            )
            return
        with self._lock:
            if self._executor is executor:
                self._ready = True
        log.info(
            "%d image preprocessing workers ready in %.1f s (first tasks on %s)",
            self.workers,
            time.perf_counter() - began,
            ", ".join(map(str, sorted(set(pids)))),
        )

    @property
    def ready(self) -> bool:
        return self._ready

    def __call__(
        self, shared: SharedImage, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image's ``pixel_values`` and ``image_grid_thw``; None: preprocess it here."""
        with self._lock:
            executor = self._executor if self._ready else None
            starting = self._executor is not None or self._closed
        if not starting:
            self.start()
        if executor is None or not _travels(kwargs):
            return None
        try:
            result = executor.submit(_preprocess, shared, kwargs).result()
        except BrokenProcessPool:
            log.warning(
                "an image preprocessing worker died; restarting the pool (this "
                "image is preprocessed in the engine process)"
            )
            self._restart(executor)
            return None
        if result == _GONE:
            raise ServiceUnavailable(
                "the request's image was gone before the engine read it (the request was "
                "cancelled or the server is stopping); retry",
                code="media_gone",
            )
        if result is None:  # not the patch-rows-plus-grid layout
            return None
        self.done += 1
        name, shape, dtype, grid = result
        count = int(np.prod(shape))
        block = take_block(name, count * np.dtype(dtype).itemsize)  # mapped: no copy here
        rows = np.frombuffer(block, dtype=dtype, count=count).reshape(shape)
        return torch.from_numpy(rows), torch.from_numpy(grid)

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken or self._closed:
                return  # another thread restarted it already
            self._executor, self._ready = None, False
            self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)
        self.start()

    def close(self) -> None:
        with self._lock:
            executor, self._executor, self._ready, self._closed = self._executor, None, False, True
        self._asked.set()  # the starter thread ends
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def _travels(kwargs: dict[str, Any]) -> bool:
    """The processor's options can go to a worker (a few small values: pickled twice is
    nothing); one that cannot is preprocessed in the engine process."""
    try:
        pickle.dumps(kwargs)
    except Exception as exc:  # pickling raises PicklingError, AttributeError, TypeError...
        log.warning("an image's preprocessing options cannot go to a worker (%s)", exc)
        return False
    return True


def _init(blob: bytes, nice: int, parent: int) -> None:
    """A worker: one torch thread (as the engine's media threads), ``nice`` lower, the
    image processor loaded; it exits when the engine process does."""
    global _inner
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the engine stops its workers
    gc.enable()  # spawned from an engine process, whose ``__main__`` pauses it (heap.py)
    torch.set_num_threads(1)
    if nice > 0:
        with contextlib.suppress(OSError):  # not permitted here: the same priority
            os.nice(nice)
    _inner = pickle.loads(blob)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _preprocess(
    shared: SharedImage, kwargs: dict[str, Any]
) -> tuple[str, tuple[int, ...], str, np.ndarray] | str | None:
    """-> the patch rows in a block of their own (name, shape, dtype: tens of MB for a photo
    at Qwen2-VL's bounds, which through the pipe would be read in 64 KiB pieces and copied
    under the engine process's GIL) and the grid; ``_GONE``; None: not that layout."""
    try:
        images, call = block_call(shared, _inner, kwargs)
    except FileNotFoundError:
        return _GONE
    out = _inner(images, **call)
    if set(out.keys()) != _KEYS:
        return None
    rows = np.ascontiguousarray(out["pixel_values"].numpy())
    return write_bytes(rows), rows.shape, rows.dtype.str, out["image_grid_thw"].numpy()
