"""Resume real streams at every index, 0 to last+3, on finished, cancelled and expired sessions.

Hypothesis picks the stream (length, usage chunk, where a cancel lands); each example then
resumes the session at every index through GET /v1/streams (header and query) and the chat
POST (header; id wire and data-only wire). Never a 5xx; the replay is exactly the events
after the index; at or past the end a 204; once expired a 404. The app runs in-process on an
event loop of its own thread, so hypothesis drives it from plain synchronous tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager

T = TypeVar("T")
Message = tuple[str | None, str | None, str]  # (id, event, data)
WAYS = ("get-header", "get-query", "post-header", "post-data-only")


class AppLoop:
    """The app and an httpx client on an event loop running in a background thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = contextlib.AsyncExitStack()
        self.client: httpx.AsyncClient

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> None:
        await self.stack.enter_async_context(self.app.router.lifespan_context(self.app))
        transport = httpx.ASGITransport(app=self.app)
        client = httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60)
        self.client = await self.stack.enter_async_context(client)

    def __enter__(self) -> AppLoop:
        self.thread.start()
        self.run(self._open())
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self.stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def served(tiny_dir: Path, chat_models: ModelManager) -> Iterator[AppLoop]:
    with AppLoop(build_app(make_settings(tiny_dir), models=chat_models)) as app:
        yield app


def parse(raw: bytes) -> list[Message]:
    out: list[Message] = []
    for block in raw.decode("utf-8").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if line)
        if fields:
            out.append((fields.get("id"), fields.get("event"), fields["data"]))
    return out


def chat(max_tokens: int, usage: bool, sid: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "session_id": sid,
        "stream_options": {"include_usage": usage},
    }


async def make_session(app: AppLoop, max_tokens: int, usage: bool, cancel_at: int | None) -> str:
    """A finished session, or (``cancel_at``) one cancelled once it has that many events."""
    sid = f"prop-{uuid.uuid4().hex[:12]}"
    if cancel_at is None:
        r = await app.client.post("/v1/chat/completions", json=chat(max_tokens, usage, sid))
        assert r.status_code == 200
        return sid
    post = app.client.post("/v1/chat/completions", json=chat(3000, usage, sid))
    stream = asyncio.ensure_future(post)
    sessions = app.app.state.services.sessions
    while (session := sessions.get(sid)) is None or session.last_index < cancel_at:
        await asyncio.sleep(0.005)
    assert (await app.client.post(f"/v1/cancel/{sid}")).status_code == 200
    assert (await asyncio.wait_for(stream, 60)).status_code == 200
    return sid


async def resume(app: AppLoop, sid: str, index: int, way: str) -> httpx.Response:
    event_id = f"{sid}:{index}"
    if way == "get-header":
        return await app.client.get(f"/v1/streams/{sid}", headers={"Last-Event-ID": event_id})
    if way == "get-query":
        return await app.client.get(f"/v1/streams/{sid}", params={"last_event_id": event_id})
    body = chat(4, False, sid)
    if way == "post-data-only":
        body["stream_options"]["resumable"] = False
    return await app.client.post(
        "/v1/chat/completions", json=body, headers={"Last-Event-ID": event_id}
    )


async def check_every_index(app: AppLoop, sid: str, reference: list[Message]) -> None:
    last = len(reference) - 1
    for index in range(last + 4):
        for way in WAYS:
            r = await resume(app, sid, index, way)
            assert r.status_code < 500, (way, index, r.text)
            if index >= last:
                assert (r.status_code, r.content) == (204, b""), (way, index, r.text)
                continue
            assert r.status_code == 200, (way, index, r.text)
            got, expected = parse(r.content), reference[index + 1 :]
            if way == "post-data-only":  # the same events, without id and event lines
                expected = [(None, None, data) for _, _, data in expected]
            assert got == expected, (way, index)


async def check_expired(app: AppLoop, sid: str, last: int) -> None:
    sessions = app.app.state.services.sessions
    await sessions.gc(now=time.time() + 10 * sessions.ttl)
    for index in range(last + 4):
        for way in WAYS:
            r = await resume(app, sid, index, way)
            assert r.status_code == 404, (way, index, r.text)
            assert r.json()["error"]["code"] == "session_not_found"


@settings(max_examples=10, deadline=None)
@given(
    max_tokens=st.integers(1, 5),
    usage=st.booleans(),
    cancel_at=st.none() | st.integers(0, 6),
)
@example(max_tokens=2, usage=True, cancel_at=None)  # finished, with a usage chunk
@example(max_tokens=1, usage=False, cancel_at=0)  # cancelled right after the role chunk
def test_resuming_at_every_index_never_fails_and_replays_exactly_the_rest(
    served: AppLoop, max_tokens: int, usage: bool, cancel_at: int | None
) -> None:
    sid = served.run(make_session(served, max_tokens, usage, cancel_at))
    whole = served.run(served.client.get(f"/v1/streams/{sid}"))
    reference = parse(whole.content)
    assert [m[0] for m in reference] == [f"{sid}:{i}" for i in range(len(reference))]
    assert reference[-1][2] == "[DONE]"
    if cancel_at is not None:
        assert json.loads(reference[-2][2])["choices"][0]["finish_reason"] == "cancelled"
    served.run(check_every_index(served, sid, reference))
    served.run(check_expired(served, sid, len(reference) - 1))
