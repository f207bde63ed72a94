"""What goes wrong in the engine, and whom it ends.

    Exception
    ├── VlmserveError
    │   ├── RequestFailed        500: this request alone (its forward fails even when it runs
    │   │                        alone, its token is outside the vocabulary, its grammar broke)
    │   └── ServiceUnavailable
    │       └── EngineFailed     503: the engine is unusable; every request of the model ends
    │                            with it, the model is marked failed and reloaded
    └── EngineStateError         an engine invariant is broken (a bug): fatal, as above

A batched forward that raises does not say which row caused it, so the engine retries each
of its rows alone (``BatchEngine._forward``): a row that fails alone is the cause and ends
with ``RequestFailed``; the others go on. If every row of a batch of two or more fails alone
the fault is the engine's, not a request's: ``EngineFailed`` for everyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from vlmserve.errors import ServiceUnavailable, VlmserveError

__all__ = [
    "EngineFailed",
    "EngineStateError",
    "RequestFailed",
    "describe",
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


class EngineStateError(RuntimeError):
    """The engine's bookkeeping contradicts itself; nothing it computes can be trusted."""


def request_error(exc: BaseException) -> BaseException:
    """What the request that caused ``exc`` ends with: our own errors (a 400 for a resumed
    prefix the grammar refuses, say) as they are, anything else as ``RequestFailed``."""
    return exc if isinstance(exc, VlmserveError) else RequestFailed(exc)


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
    the engine is broken, not the requests: ``EngineStateError``."""
    log.warning("a batched step of %d rows failed (%r); retrying each row alone",
                len(items), cause)  # fmt: skip
    kept: list[_Item] = []
    tokens: list[int] = []
    culprits = 0
    for item in items:
        try:
            tokens += forward([item])
        except Exception as exc:
            culprits += fail(item, exc)
            continue
        kept.append(item)
    if len(items) > 1 and culprits == len(items):
        raise EngineStateError(f"every row of a batch of {len(items)} fails") from cause
    return kept, tokens
