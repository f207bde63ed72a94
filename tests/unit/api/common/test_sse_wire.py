"""``sse_response`` on each wire: data-only by default, ``id:``/``event:`` lines when asked;
error events, stream_gap notices and the end of a stream (no model: numbered producers)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from fastapi.responses import StreamingResponse

from vlmserve.api.common.sse import accepts_event_stream, sse_response
from vlmserve.streaming import Emit, MemoryStore, SessionManager, error_emit

ERROR = json.dumps(
    {"error": {"message": "boom", "type": "server_error", "param": None, "code": "internal_error"}}
)


def producer(n: int, fail: bool = False) -> AsyncIterator[Emit]:
    async def gen() -> AsyncIterator[Emit]:
        for i in range(n):
            yield Emit(json.dumps({"i": i}))
        if fail:
            raise RuntimeError("backend died")

    return gen()


async def ended(manager: SessionManager, sid: str, n: int, fail: bool = False) -> None:
    session = await manager.start(
        sid,
        {},
        producer(n, fail),
        on_cancel=list,
        on_error=lambda exc: [error_emit("boom", "internal_error")],
    )
    await asyncio.wait_for(session.wait(), 10)


async def body(manager: SessionManager, sid: str, after: int, resumable: bool) -> bytes:
    response = await sse_response(manager, sid, after, resumable=resumable)
    assert isinstance(response, StreamingResponse)
    assert response.headers["x-session-id"] == sid
    return b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[misc]


async def test_an_error_goes_out_as_data_then_done_on_the_openai_wire() -> None:
    manager = SessionManager(MemoryStore(), gc_interval=0)
    await ended(manager, "s", 2, fail=True)
    raw = await body(manager, "s", -1, resumable=False)
    assert raw.decode() == (
        f'data: {{"i": 0}}\n\ndata: {{"i": 1}}\n\ndata: {ERROR}\n\ndata: [DONE]\n\n'
    )
    resumable = await body(manager, "s", 1, resumable=True)
    assert (
        resumable.decode() == f"id: s:2\nevent: error\ndata: {ERROR}\n\nid: s:3\ndata: [DONE]\n\n"
    )
    await manager.close()


async def test_a_stream_gap_notice_is_closed_with_done_on_the_openai_wire() -> None:
    manager = SessionManager(MemoryStore(), ring_size=2, gc_interval=0)
    await ended(manager, "s", 6)
    plain = (await body(manager, "s", 0, resumable=False)).decode().split("\n\n")
    assert json.loads(plain[0].removeprefix("data: "))["error"]["code"] == "stream_gap"
    assert plain[1:] == ["data: [DONE]", ""]
    with_ids = (await body(manager, "s", 0, resumable=True)).decode()
    assert with_ids.startswith("id: s:0\nevent: error\n") and "[DONE]" not in with_ids
    await manager.close()


@pytest.mark.parametrize("resumable", [True, False])
async def test_nothing_after_the_index_of_an_ended_session_is_204(resumable: bool) -> None:
    manager = SessionManager(MemoryStore(), gc_interval=0)
    await ended(manager, "s", 3)  # events 0, 1, 2 and [DONE] at 3
    for after in (3, 4, 10**9):
        response = await sse_response(manager, "s", after, resumable=resumable)
        assert response.status_code == 204 and response.body == b""
        assert response.headers["x-session-id"] == "s"
    await manager.close()


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("text/event-stream", True),
        ("Text/Event-Stream; charset=utf-8", True),
        ("application/json, text/event-stream;q=0.1", True),
        ("text/event-stream;q=0", False),
        ("text/event-stream;q=nonsense", True),
        ("application/json", False),
        ("*/*", False),
        ("", False),
        (None, False),
    ],
)
def test_accepts_event_stream(accept: str | None, expected: bool) -> None:
    assert accepts_event_stream(accept) is expected
