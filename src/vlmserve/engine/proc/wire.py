"""What the API process and the engine process say to each other, over one duplex
``multiprocessing`` connection (pickled tuples; the first item names the message).

API -> engine, one message per send:

    ("prepare", rid, GenerateRequest)   tokenise, preprocess, compile the grammar (its images
                                        as SharedImage names of shared memory blocks: pixels.py)
    ("generate", rid)                   run a prepared request, stream its chunks
    ("cancel", rid)                     stop it at the next step boundary
    ("discard", rid)                    drop a prepared request that will not run
    ("tokenize", rid, GenerateRequest | str, add_special_tokens)   a prompt's ids (Tokenized)
    ("detokenize", rid, [int])          the text of token ids
    ("close",)                          unload and exit

Engine -> API, a list of messages per send (a step's chunks of every stream go together):

    ("ready", Ready) | ("load_failed", error)
    ("done", rid, None)                 prepare / discard finished
    ("chunk", rid, Chunk) | ("end", rid) | ("error", rid, error)
    ("stats", BackendStats, memory_bytes)
    ("failed", message)                 the engine failed for good (a reload is due)

Errors travel as (class, args, attributes) and are rebuilt without calling the class's
``__init__`` (whose signature may not be ``(message)``), so the API process raises the very
exception type the engine raised: a 400 stays a 400, an out-of-memory stays a 503.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from vlmserve.errors import VlmserveError

__all__ = ["Error", "Ready", "Sender", "decode_error", "encode_error", "read_forever"]

Error = tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]


@dataclass(slots=True)
class Ready:
    """What the engine process reports once its model is loaded."""

    capabilities: frozenset[str] | None
    memory_bytes: int
    load_seconds: float | None
    max_queued: int  # queue places (VLMSERVE_MAX_QUEUED_REQUESTS): admission in the API process
    video_sampling: Any = None  # media.sampling.VideoSampling: the family's frame rule


def encode_error(exc: BaseException) -> Error:
    """``exc`` as picklable parts; an error that cannot travel becomes a 500 with its text."""
    parts: Error = (type(exc), tuple(exc.args), dict(getattr(exc, "__dict__", {})))
    try:
        pickle.loads(pickle.dumps(parts))
    except Exception:
        text = f"{type(exc).__name__}: {exc}"
        return VlmserveError, (text,), {"message": text, "param": None, "code": None}
    return parts


def decode_error(parts: Error) -> BaseException:
    cls, args, attributes = parts
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc


class Sender:
    """Sends from any thread without blocking it: one writer thread owns the connection's
    sending side (a large request, images and all, never stalls the event loop)."""

    def __init__(self, conn: Connection, name: str):
        self._conn = conn
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def stop(self) -> None:
        self._queue.put(_STOP)

    def _write(self) -> None:
        while (message := self._queue.get()) is not _STOP:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the other side is gone; the reader reports it
                return


_STOP = object()


def read_forever(conn: Connection, handle: Callable[[Any], None]) -> None:
    """On a reader thread: every message to ``handle``, then ``None`` once the other side
    has closed the connection (or died)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            handle(None)
            return
        handle(message)
