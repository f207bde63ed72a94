"""What goes wrong in the engine, and whom it ends.

    Exception
    ├── VlmserveError
    │   ├── RequestFailed        500: this request alone (its forward fails even when it runs
    │   │                        alone, its token is outside the vocabulary, its grammar broke)
    │   └── ServiceUnavailable
    │       ├── OutOfMemory      503 + Retry-After: this request alone ran out of (device)
    │       │                    memory, even alone; the engine goes on
    │       └── EngineFailed     503: the engine is unusable; every request of the model ends
    │                            with it, the model is marked failed and reloaded
    ├── EngineStateError         an engine invariant is broken (a bug): fatal, as above
    └── EngineStalled            the engine had requests but no step started or ended for
                                 the liveness timeout (a hung kernel, a deadlock): fatal

A batched forward that raises does not say which row caused it, so the engine retries each
of its rows alone (``BatchEngine._forward``): a row that fails alone is the cause and ends
with ``RequestFailed`` (``OutOfMemory`` when it ran out of memory); the others go on. If
every row of a batch of two or more fails alone the fault is the engine's, not a request's:
``EngineFailed`` for everyone; unless each of them ran out of memory, which says the memory
is short, not that the engine is broken: they end with ``OutOfMemory`` and the engine lives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from vlmserve.errors import ServiceUnavailable, VlmserveError

__all__ = [
    "EngineFailed",
    "EngineStalled",
    "EngineStateError",
    "OutOfMemory",
    "RequestFailed",
    "describe",
    "out_of_memory",
    "request_error",
    "retry_alone",
]

log = logging.getLogger(__name__)
_Item = TypeVar("_Item")

_MAX_DETAIL = 300  # characters of an exception's text kept for /health and /admin/state


class RequestFailed(VlmserveError):
    default_code = "generation_failed"

    def __init__(self, cause: BaseException):
        super().__init__(
            f"generation failed for this request ({type(cause).__name__}); other requests "
            "were not affected; the server log has the details"
        )


class EngineFailed(ServiceUnavailable):
    default_code = "engine_failed"

    def __init__(self, model_id: str, cause: BaseException):
        super().__init__(
            f"model {model_id!r} stopped: its engine failed ({type(cause).__name__}); it is "
            "being reloaded, retry in a few seconds",
            retry_after=10,
        )
        self.detail = describe(cause)


class OutOfMemory(ServiceUnavailable):
    default_code = "out_of_memory"

    def __init__(self, cause: BaseException):
        super().__init__(
            f"the model ran out of memory running this request ({type(cause).__name__}), "
            "even alone; other requests were not affected. Retry in a few seconds, or send a "
            "smaller request (fewer or smaller images, a shorter prompt)",
            retry_after=5,
        )


def out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: torch's ``OutOfMemoryError`` (CUDA, MPS) or the CPU allocator's
    ``RuntimeError`` ("can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


class EngineStateError(RuntimeError):
    """The engine's bookkeeping contradicts itself; nothing it computes can be trusted."""


class EngineStalled(RuntimeError):
    """The engine had work and made no progress for longer than the liveness timeout."""

    def __init__(self, seconds: float, longest_step: float):
        super().__init__(
            f"no engine step started or ended for {seconds:.1f} s with requests pending (the "
            f"longest step so far took {longest_step:.2f} s; VLMSERVE_LIVENESS_TIMEOUT)"
        )


def request_error(exc: BaseException) -> BaseException:
    """What the request that caused ``exc`` ends with: our own errors (a 400 for a resumed
    prefix the grammar refuses, say) as they are, running out of memory as ``OutOfMemory``
    (503, retry), anything else as ``RequestFailed``."""
    if isinstance(exc, VlmserveError):
        return exc
    return OutOfMemory(exc) if out_of_memory(exc) else RequestFailed(exc)


def describe(exc: BaseException) -> str:
    """``Type: message``, bounded (for logs, ``/health`` and ``/admin/state``)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def retry_alone(
    forward: Callable[[list[_Item]], list[int]],
    items: list[_Item],
    cause: Exception,
    fail: Callable[[_Item, BaseException], bool],
) -> tuple[list[_Item], list[int]]:
    """``forward(items)`` raised ``cause``: run each row alone. A row that raises again is the
    cause: ``fail(row, exc)`` ends it (False: it had left the batch already). Returns the rows
    that went through and their tokens. If every row of a batch of two or more fails alone,
    the engine is broken, not the requests: ``EngineStateError`` (unless each of them ran
    out of memory: memory is short, the engine is not broken)."""
    log.warning("a batched step of %d rows failed (%r); retrying each row alone", len(items), cause)
    kept: list[_Item] = []
    tokens: list[int] = []
    culprits = short = 0
    for item in items:
        try:
            tokens += forward([item])
        except Exception as exc:
            culprits += fail(item, exc)
            short += out_of_memory(exc)
            continue
        kept.append(item)
    if len(items) > 1 and culprits == len(items) and short < len(items):
        raise EngineStateError(f"every row of a batch of {len(items)} fails") from cause
    return kept, tokens
