"""Resume tokens with API keys configured: a browser's EventSource, which cannot send a key,
resumes its own stream with ``?token=`` and nothing else; the ownership of streams and their
tokens holds across a restart (SQLite) and across replicas (Redis); a response resumed ahead
of its producer waits for its events (the background example of docs/api.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager

A, B = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
KEYS = {"api_keys": ["k1", "k2"]}


def chat(max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def messages(raw: bytes) -> list[dict[str, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            out.append(dict(line.split(": ", 1) for line in block.split("\n")))
    return out


async def test_a_resume_token_opens_its_own_stream_and_nothing_else(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client(**KEYS)
    r = await http.post("/v1/chat/completions", json=chat(), headers=A)
    sid, token = r.headers["x-session-id"], r.headers["x-resume-token"]
    first = json.loads(messages(r.content)[0]["data"])
    assert first["resume_token"] == token and len(token) >= 32
    alias = first["id"]
    assert (await http.get(f"/v1/streams/{sid}")).status_code == 401  # no key, no token
    whole = await http.get(f"/v1/streams/{sid}", params={"token": token})
    assert whole.status_code == 200
    events = messages(whole.content)
    assert [e["id"] for e in events] == [f"{sid}:{i}" for i in range(len(events))]
    assert "resume_token" not in events[0]["data"] and events[-1]["data"] == "[DONE]"
    later = await http.get(
        f"/v1/streams/{sid}", params={"token": token}, headers={"Last-Event-ID": f"{sid}:2"}
    )
    assert messages(later.content)[0]["id"] == f"{sid}:3"
    by_alias = await http.get(f"/v1/streams/{alias}", params={"token": token})
    assert [e["data"] for e in messages(by_alias.content)] == [e["data"] for e in events]

    mine = await http.post("/v1/chat/completions", json=chat(), headers=A)
    theirs = await http.post("/v1/chat/completions", json=chat(), headers=B)
    unknown = await http.get("/v1/streams/nobody", params={"token": token})
    assert unknown.status_code == 404
    for other in (mine, theirs):  # another session, the same key's or another's
        name = other.headers["x-session-id"]
        opened = await http.get(f"/v1/streams/{name}", params={"token": token})
        assert opened.status_code == 404
        assert opened.text.replace(name, "nobody") == unknown.text
    other_last = "y" if token.endswith("x") else "x"  # (a token may end in "x" itself)
    wrong = await http.get(f"/v1/streams/{sid}", params={"token": token[:-1] + other_last})
    assert wrong.status_code == 404
    # a key decides whose namespace a request reads; the token adds nothing to it
    assert (
        await http.get(f"/v1/streams/{sid}", params={"token": token}, headers=B)
    ).status_code == 404
    # no other route takes a token
    for method, path in (
        ("POST", f"/v1/cancel/{sid}"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/files"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/responses/{sid}"),
        ("DELETE", f"/v1/responses/{sid}"),
        ("GET", f"/v1/streams/{sid}/x"),
        ("GET", f"/v1/streams/..%2F{sid}"),
    ):
        refused = await http.request(method, path, params={"token": token})
        assert refused.status_code == 401, (method, path)
    # a chat stream's token on the responses route is an unknown response
    as_response = await http.get(f"/v1/responses/{sid}", params={"token": token, "stream": "true"})
    assert as_response.status_code == 404


async def test_a_response_token_opens_its_events_only(make_client: Callable[..., Any]) -> None:
    http = await make_client(**KEYS)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    made = await http.post("/v1/responses", json={**body, "background": True}, headers=A)
    rid, token = made.json()["id"], made.headers["x-resume-token"]
    while (await http.get(f"/v1/responses/{rid}", headers=A)).json()["status"] not in (
        "completed",
        "incomplete",
    ):
        await asyncio.sleep(0.05)
    events = await http.get(f"/v1/responses/{rid}", params={"token": token, "stream": "true"})
    assert events.status_code == 200
    kinds = [e["event"] for e in messages(events.content)]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    after = await http.get(
        f"/v1/responses/{rid}", params={"token": token, "stream": "true", "starting_after": 1}
    )
    numbers = [json.loads(e["data"])["sequence_number"] for e in messages(after.content)]
    assert numbers[0] == 2
    assert (await http.get(f"/v1/responses/{rid}", params={"token": token})).status_code == 401
    assert (await http.get(f"/v1/streams/{rid}", params={"token": token})).status_code == 404
    streamed = await http.post("/v1/responses", json={**body, "stream": True}, headers=A)
    opening = json.loads(messages(streamed.content)[0]["data"])
    assert opening["resume_token"] == streamed.headers["x-resume-token"]
    assert opening["type"] == "response.created"


async def test_the_readmes_background_example_resumes_ahead_of_its_producer(
    make_client: Callable[..., Any],
) -> None:
    """``retrieve(id, stream=True, starting_after=3)`` at once after ``create(background=True)``:
    the response may have made fewer events yet; the stream waits for them (20 of 20)."""
    http = await make_client()
    api = openai.AsyncOpenAI(
        base_url="http://vlmserve.test/v1", api_key="unused", http_client=http, max_retries=0
    )
    for _ in range(20):
        started = await api.responses.create(
            model=MODEL, input="Tell me a story", background=True, max_output_tokens=8
        )
        stream = await api.responses.retrieve(started.id, stream=True, starting_after=3)
        events = [event async for event in stream]
        assert [e.sequence_number for e in events] == list(range(4, 4 + len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")


@contextlib.asynccontextmanager
async def app_on(
    tiny_dir: Path, models: ModelManager, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """One server's app (a replica, or one run of a restarted server); its store is closed
    when it stops, as the process's end would leave it."""
    app = build_app(make_settings(tiny_dir, **KEYS, **overrides), models=models)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                yield http
    finally:
        await app.state.services.sessions.store.close()


async def check_owned(http: httpx.AsyncClient, sid: str, token: str, sent: bytes) -> None:
    mine = await http.get(f"/v1/streams/{sid}", headers=A)
    assert mine.status_code == 200 and messages(mine.content)[-1]["data"] == "[DONE]"
    assert len(messages(mine.content)) == len(messages(sent))
    assert (await http.get(f"/v1/streams/{sid}", headers=B)).status_code == 404
    started = await http.post("/v1/chat/completions", json=chat(2, session_id=sid), headers=B)
    assert started.status_code == 200  # B's own "sid", not a 400 session_exists
    by_token = await http.get(f"/v1/streams/{sid}", params={"token": token})
    assert [e["data"] for e in messages(by_token.content)] == [
        e["data"] for e in messages(mine.content)
    ]


async def test_ownership_and_tokens_survive_a_restart(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    db = {"persist_sessions": True, "sessions_db_path": str(tmp_path / "sessions.db")}
    async with app_on(tiny_dir, chat_models, **db) as before:
        r = await before.post("/v1/chat/completions", json=chat(session_id="kept"), headers=A)
    async with app_on(tiny_dir, chat_models, **db) as after:
        await check_owned(after, "kept", r.headers["x-resume-token"], r.content)


async def test_ownership_and_tokens_hold_on_another_replica(
    tiny_dir: Path, chat_models: ModelManager, redis_url: str
) -> None:
    async with (
        app_on(tiny_dir, chat_models, redis_url=redis_url) as one,
        app_on(tiny_dir, chat_models, redis_url=redis_url) as two,
    ):
        r = await one.post("/v1/chat/completions", json=chat(session_id="shared"), headers=A)
        await check_owned(two, "shared", r.headers["x-resume-token"], r.content)
