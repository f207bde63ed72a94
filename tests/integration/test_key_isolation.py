"""What one API key can see of another's streams: nothing. The app in-process with two keys.

Key B asks for key A's chat stream by its session id and by its ``chatcmpl-`` alias on every
stream route (read, resume, cancel) and gets exactly what an unknown id gets; the two keys may
use the same ``session_id``; B's chat ``session_id: "<A's response id>.deleted"`` leaves A's
response alone; a key over its concurrency cap gets a 429; with keys configured, one key's
prompt blocks are not another key's prefix-cache hits (unless the scope is global).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sse_client import RESUMABLE
from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.api.services import Services
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
        **extra,
    }


def data_of(raw: bytes) -> list[str]:
    return [m.split("\n")[-1].removeprefix("data: ") for m in raw.decode().split("\n\n") if m]


def services(http: httpx.AsyncClient) -> Services:
    return http._transport.app.state.services  # type: ignore[attr-defined,no-any-return]


async def running(http: httpx.AsyncClient, count: int = 1) -> None:
    """Until ``count`` streams generate (the app's own session count)."""
    for _ in range(1000):
        if services(http).sessions.active_count() >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the stream did not start")


async def as_unknown(
    http: httpx.AsyncClient,
    method: str,
    path: str,
    name: str,
    headers: dict[str, str] | None = None,
    body: Any = None,
) -> None:
    """B's answer for ``name`` in ``path`` is the answer for a name no one has."""
    answers = []
    for asked in (name, "x" * len(name)):
        given = {k: v.replace(name, asked) for k, v in (headers or {}).items()}
        sent = None if body is None else json.loads(json.dumps(body).replace(name, asked))
        r = await http.request(method, path.format(asked), headers={**B, **given}, json=sent)
        answers.append((r.status_code, r.text.replace(asked, "<name>")))
    assert answers[0] == answers[1] and answers[0][0] == 404, (path, answers)


async def test_another_key_gets_an_unknown_ids_404_on_every_stream_route(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client(**KEYS)
    stream = asyncio.ensure_future(
        http.post(
            "/v1/chat/completions",
            json=chat(3000, stream=True, session_id="mine"),
            headers={**A, **RESUMABLE},
        )
    )
    await running(http)
    held = services(http).sessions.sessions  # stored names: "<A's key digest>/mine"
    session = next(s for name, s in held.items() if name.endswith("/mine"))
    alias = next(a for a in session.record.aliases if "chatcmpl-" in a).split("/")[-1]
    for name in ("mine", alias):
        await as_unknown(http, "POST", "/v1/cancel/{}", name)
        await as_unknown(http, "POST", "/v1/chat/completions/{}/cancel", name)
        await as_unknown(http, "GET", "/v1/streams/{}", name)
        await as_unknown(
            http, "GET", "/v1/streams/{}", name, headers={"Last-Event-ID": f"{name}:0"}
        )
        await as_unknown(
            http,
            "POST",
            "/v1/chat/completions",
            name,
            headers={"Last-Event-ID": f"{name}:0"},
            body=chat(),
        )
    assert not stream.done() and session.running  # B touched nothing
    cancelled = await http.post(f"/v1/chat/completions/{alias}/cancel", headers=A)
    assert cancelled.status_code == 200
    answer = await asyncio.wait_for(stream, 60)
    assert answer.status_code == 200 and data_of(answer.content)[-1] == "[DONE]"
    # ended and stored: still A's alone
    await as_unknown(http, "GET", "/v1/streams/{}", "mine")
    replay = await http.get("/v1/streams/mine", headers=A)
    assert replay.status_code == 200 and data_of(replay.content)[-1] == "[DONE]"


async def test_two_keys_use_the_same_session_id_independently(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client(**KEYS)
    made = {}
    for key, tokens in ((A, 3), (B, 9)):
        r = await http.post(
            "/v1/chat/completions", headers=key, json=chat(tokens, stream=True, session_id="same")
        )
        assert r.status_code == 200, r.text  # never a 400 session_exists for B
        assert r.headers["x-session-id"] == "same"
        made[key["Authorization"]] = r
    again = await http.post(
        "/v1/chat/completions", headers=A, json=chat(stream=True, session_id="same")
    )
    assert again.status_code == 400 and again.json()["error"]["code"] == "session_exists"
    for key in (A, B):
        replay = await http.get("/v1/streams/same", headers=key)
        sent = made[key["Authorization"]]
        assert len(data_of(replay.content)) == len(data_of(sent.content))  # its own events
    assert len(data_of(made[A["Authorization"]].content)) != len(
        data_of(made[B["Authorization"]].content)
    )


async def test_another_keys_deleted_session_name_leaves_a_response_alone(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client(**KEYS)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    made = (await http.post("/v1/responses", json=body, headers=A)).json()
    trick = await http.post(
        "/v1/chat/completions",
        headers=B,
        json=chat(2, stream=True, session_id=f"{made['id']}.deleted"),
    )
    assert trick.status_code == 200
    kept = await http.get(f"/v1/responses/{made['id']}", headers=A)
    assert kept.status_code == 200 and kept.json()["output"] == made["output"]
    assert (await http.delete(f"/v1/responses/{made['id']}", headers=A)).status_code == 200
    assert (await http.get(f"/v1/responses/{made['id']}", headers=A)).status_code == 404


async def test_a_key_over_its_concurrency_cap_gets_a_429(make_client: Callable[..., Any]) -> None:
    http = await make_client(**KEYS, max_concurrent_per_key=1)
    stream = asyncio.ensure_future(
        http.post("/v1/chat/completions", json=chat(3000, stream=True), headers=A)
    )
    await running(http)
    over = await http.post("/v1/chat/completions", json=chat(2), headers=A)
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
    error = over.json()["error"]
    assert error["code"] == "key_concurrency_limit" and error["type"] == "rate_limit_error"
    assert "VLMSERVE_MAX_CONCURRENT_PER_KEY" in error["message"]
    background = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "background": True}
    assert (await http.post("/v1/responses", json=background, headers=A)).status_code == 429
    assert (await http.post("/v1/chat/completions", json=chat(2), headers=B)).status_code == 200
    sid = next(iter(services(http).sessions.sessions)).split("/")[1]  # "<digest>/<id>"
    assert (await http.post(f"/v1/cancel/{sid}", headers=A)).status_code == 200
    await asyncio.wait_for(stream, 60)
    assert (await http.post("/v1/chat/completions", json=chat(2), headers=A)).status_code == 200


SYSTEM = "You read identity cards and answer with the one field asked for. " * 6


@asynccontextmanager
async def serving(tiny_dir: Path, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An app with its own model (its own prefix cache)."""
    settings = make_settings(tiny_dir, enable_prefix_caching=True, **KEYS, **overrides)
    models = ModelManager.from_settings(settings)
    for handle in models.handles:
        handle.backend.load()
    app = build_app(settings, models=models)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                yield c
    finally:
        models.close()


async def cached_tokens(http: httpx.AsyncClient, key: dict[str, str], question: str) -> int:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    r = await http.post("/v1/chat/completions", json=body, headers=key)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("scope", ["key", "global"])
async def test_prefix_cache_blocks_are_shared_only_within_a_key_unless_global(
    tiny_dir: Path, scope: str
) -> None:
    async with serving(tiny_dir, prefix_cache_scope=scope) as http:
        assert await cached_tokens(http, A, "Name?") == 0
        assert await cached_tokens(http, A, "Date of birth?") >= 5 * 16  # A's own blocks
        other = await cached_tokens(http, B, "Card number?")
        if scope == "key":
            assert other == 0  # B cannot time A's prompt: nothing of it is B's hit
        else:
            assert other >= 5 * 16


async def batch_cached_tokens(http: httpx.AsyncClient, key: dict[str, str], question: str) -> int:
    """``cached_tokens`` of one chat line run as a batch of ``key``'s."""
    line = {
        "custom_id": "q",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "max_tokens": 2,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
        },
    }
    data = (json.dumps(line) + "\n").encode()
    up = await http.post(
        "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}, headers=key
    )
    assert up.status_code == 200, up.text
    made = await http.post(
        "/v1/batches",
        headers=key,
        json={
            "input_file_id": up.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert made.status_code == 200, made.text
    for _ in range(3000):
        batch = (await http.get(f"/v1/batches/{made.json()['id']}", headers=key)).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(0.02)
    assert batch["status"] == "completed", batch
    out = await http.get(f"/v1/files/{batch['output_file_id']}/content", headers=key)
    answer = json.loads(out.content.splitlines()[0])["response"]["body"]
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_batch_line_shares_prefix_blocks_only_with_its_own_key(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as http:
        assert await batch_cached_tokens(http, A, "Name?") == 0
        assert await batch_cached_tokens(http, B, "Card number?") == 0  # not A's batch's blocks
        assert await batch_cached_tokens(http, A, "Date of birth?") >= 5 * 16  # A's own
        assert await cached_tokens(http, A, "Address?") >= 5 * 16  # and A's chats share them
