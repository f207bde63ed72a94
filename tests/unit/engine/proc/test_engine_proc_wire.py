"""The engine process's wire and admission, without a process: errors cross the connection as
the very exception they were (type, status, code, param, Retry-After), an error that cannot
travel becomes a plain 500 with its text, and the API process's queue bound is a 429."""

from __future__ import annotations

import pickle
import threading

import pytest

from vlmserve.engine.core.faults import EngineFailed, OutOfMemory
from vlmserve.engine.proc.client import EngineProcClient, _Stream
from vlmserve.engine.proc.wire import Ready, decode_error, encode_error
from vlmserve.engine.types import ModelState
from vlmserve.errors import InvalidRequest, Overloaded, VlmserveError


def crossed(exc: BaseException) -> BaseException:
    """``exc`` as the other process sees it."""
    return decode_error(pickle.loads(pickle.dumps(encode_error(exc))))


def test_errors_arrive_as_the_exception_they_were() -> None:
    bad = crossed(InvalidRequest("prompt too long", param="messages", code="context_length"))
    assert type(bad) is InvalidRequest and bad.status_code == 400
    assert (str(bad), bad.param, bad.code) == ("prompt too long", "messages", "context_length")
    failed = crossed(EngineFailed("tiny", RuntimeError("boom")))  # __init__(model_id, cause)
    assert type(failed) is EngineFailed and failed.code == "engine_failed"
    assert failed.retry_after == 10 and "RuntimeError: boom" in failed.detail
    oom = crossed(OutOfMemory(RuntimeError("can't allocate memory")))
    assert type(oom) is OutOfMemory and oom.status_code == 503 and oom.retry_after == 5
    plain = crossed(ValueError("odd"))
    assert type(plain) is ValueError and str(plain) == "odd"


def test_an_error_that_cannot_travel_is_a_500_with_its_text() -> None:
    exc = RuntimeError("held a lock")
    exc.lock = threading.Lock()  # type: ignore[attr-defined]  # not picklable
    got = crossed(exc)
    assert type(got) is VlmserveError and got.status_code == 500
    assert str(got) == "RuntimeError: held a lock"


def test_admission_counts_streams_without_output_and_reserved_places() -> None:
    client = EngineProcClient("tiny", factory=dict)
    client.state, client._ready = ModelState.READY, Ready(None, 0, None, max_queued=2)
    first = client.admit()
    client._streams[1] = _Stream(loop=None)  # type: ignore[arg-type]  # waiting for output
    with pytest.raises(Overloaded, match="2 requests are already waiting"):
        client.admit()
    client._streams[1].started = True  # decoding: no longer waiting
    second = client.admit()
    first()
    first()  # idempotent
    third = client.admit()
    with pytest.raises(Overloaded):
        client.admit()
    second(), third()
    assert client._places.reserved == 0
