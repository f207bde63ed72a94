"""Resumable SSE streams and cancel through the HTTP API, on a live uvicorn with the tiny model."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

from sse_client import RESUMABLE, SSEEvent, iter_events, read_events, text_of, without_token
from support import MODEL
from vlmserve.registry.manager import ModelManager


def body(max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def assert_complete(events: list[SSEEvent]) -> None:
    indices = [e.index for e in events]
    assert indices == list(range(len(events))), indices  # 0 duplicated, 0 missing, in order
    assert events[-1].data == "[DONE]"


def tokens_generated(models: ModelManager) -> int:
    return models.resolve(MODEL).backend.tokens_generated


def test_stream_equals_json_and_every_event_has_an_id(live_server: Any) -> None:
    server = live_server()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        events, response = read_events(c, "POST", "/v1/chat/completions", json=body())
        full = c.post("/v1/chat/completions", json={**body(), "stream": False}).json()
    assert_complete(events)
    sid = response.headers["x-session-id"]
    assert all(e.id.startswith(f"{sid}:") for e in events)
    assert text_of(events) == full["choices"][0]["message"]["content"]
    assert events[-2].finish_reason == "length"


def test_resume_after_disconnect_at_random_points(live_server: Any) -> None:
    server = live_server()
    rng = random.Random(7)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        reference, _ = read_events(c, "POST", "/v1/chat/completions", json=body(40))
        expected = text_of(reference)
        for k in sorted(rng.sample(range(1, len(reference)), 12)):
            first, response = read_events(c, "POST", "/v1/chat/completions", json=body(40), limit=k)
            sid = response.headers["x-session-id"]
            headers = {"Last-Event-ID": first[-1].id}
            rest, _ = read_events(
                c,
                "POST",
                "/v1/chat/completions",
                json={**body(40), "session_id": sid},
                headers=headers,
            )
            assert_complete(first + rest)
            assert text_of(first + rest) == expected, f"resumed after {k} events"


def test_resume_with_get_and_query_parameter(live_server: Any) -> None:
    server = live_server()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        first, response = read_events(c, "POST", "/v1/chat/completions", json=body(), limit=3)
        sid = response.headers["x-session-id"]
        rest, _ = read_events(
            c, "GET", f"/v1/streams/{sid}", params={"last_event_id": first[-1].id}
        )
        whole, _ = read_events(c, "GET", f"/v1/streams/{sid}")
    assert_complete(first + rest)
    # the answer that started it carries its resume token first in its first event; a replay
    # is the stored events as they are
    opening = json.loads(first[0].data)
    assert opening.pop("resume_token") == response.headers["x-resume-token"]
    assert json.loads(whole[0].data) == opening
    assert [e.data for e in whole[1:]] == [e.data for e in (first + rest)[1:]]


def test_two_listeners_see_identical_sequences(live_server: Any) -> None:
    server = live_server()
    results: dict[str, list[SSEEvent]] = {}
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body(200), headers=RESUMABLE) as response,
    ):
        sid = response.headers["x-session-id"]
        second = threading.Thread(
            target=lambda: results.update(
                b=read_events(httpx.Client(base_url=server.url), "GET", f"/v1/streams/{sid}")[0]
            )
        )
        second.start()
        results["a"] = list(iter_events(response))
        second.join(60)
    assert_complete(results["a"])
    assert [(e.id, without_token(e.data)) for e in results["a"]] == [
        (e.id, e.data) for e in results["b"]
    ]


def test_unknown_session_is_404_and_bad_event_id_400(live_server: Any) -> None:
    server = live_server()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        missing = c.get("/v1/streams/nope", headers={"Last-Event-ID": "nope:3"})
        garbage = c.get("/v1/streams/nope", headers={"Last-Event-ID": "no-index-here"})
        cancel = c.post("/v1/cancel/nope")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert garbage.status_code == 400
    assert cancel.status_code == 404


def test_ring_overflow_without_persistence_gives_a_stream_gap(live_server: Any) -> None:
    server = live_server(stream_ring_size=4)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        events, response = read_events(c, "POST", "/v1/chat/completions", json=body(30))
        sid = response.headers["x-session-id"]
        replay, _ = read_events(
            c, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": f"{sid}:0"}
        )
        tail, _ = read_events(
            c, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": events[-3].id}
        )
    assert len(replay) == 1 and replay[0].event == "error"
    assert replay[0].json["error"]["code"] == "stream_gap"
    assert [e.data for e in tail] == [e.data for e in events[-2:]]


def _wait_until_idle(models: ModelManager, settle: float = 0.3, timeout: float = 30) -> int:
    """Block until the engine stops producing tokens; return the counter then."""
    deadline = time.monotonic() + timeout
    last = tokens_generated(models)
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = tokens_generated(models)
        if now == last:
            return now
        last = now
    raise AssertionError("engine kept generating")


def test_cancel_stops_generation_and_all_listeners_get_the_terminal_event(
    live_server: Any, chat_models: ModelManager
) -> None:
    server = live_server()
    results: dict[str, list[SSEEvent]] = {}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body(3000)) as response:
            sid = response.headers["x-session-id"]
            watcher = threading.Thread(
                target=lambda: results.update(
                    b=read_events(httpx.Client(base_url=server.url), "GET", f"/v1/streams/{sid}")[0]
                )
            )
            watcher.start()
            time.sleep(0.2)
            assert c.post(f"/v1/cancel/{sid}").json()["cancelled"] is True
            results["a"] = list(iter_events(response))
            watcher.join(60)
        before = _wait_until_idle(chat_models)
        time.sleep(0.3)
        assert tokens_generated(chat_models) == before  # the engine produced nothing more
        again = c.post(f"/v1/cancel/{sid}")
    for events in results.values():
        assert events[-1].data == "[DONE]"
        assert events[-2].finish_reason == "cancelled"
        assert len(events) < 3000
    assert again.status_code == 404


def test_cancel_by_completion_id(live_server: Any, chat_models: ModelManager) -> None:
    server = live_server()
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body(3000)) as response,
    ):
        events = iter_events(response)
        first = next(events)
        completion_id = first.json["id"]
        assert c.post(f"/v1/chat/completions/{completion_id}/cancel").status_code == 200
        rest = list(events)
    assert rest[-2].finish_reason == "cancelled"


def test_auto_cancel_fires_after_the_grace_period_not_before(
    live_server: Any, chat_models: ModelManager
) -> None:
    server = live_server(cancel_after_disconnect_seconds=1.0)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        first, response = read_events(c, "POST", "/v1/chat/completions", json=body(3500), limit=2)
        sid = response.headers["x-session-id"]
        at_disconnect = tokens_generated(chat_models)
        time.sleep(0.5)
        assert tokens_generated(chat_models) > at_disconnect  # still generating in the grace period
        stopped_at = _wait_until_idle(chat_models)
        rest, _ = read_events(
            c, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": first[-1].id}
        )
    assert rest[-2].finish_reason == "cancelled"
    assert stopped_at - at_disconnect < 3500


def test_non_streaming_request_is_cancelled_when_the_client_leaves(
    live_server: Any, chat_models: ModelManager
) -> None:
    server = live_server()
    payload = {**body(3500), "stream": False}
    start = tokens_generated(chat_models)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as c:
        c.post("/v1/chat/completions", json=payload)
    stopped = _wait_until_idle(chat_models)
    assert stopped - start < 3500


def test_continuous_usage_stats_put_running_usage_on_every_content_chunk(live_server: Any) -> None:
    server = live_server()
    options = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        events, _ = read_events(
            c, "POST", "/v1/chat/completions", json=body(6, stream_options=options)
        )
    counts = [
        e.json["usage"]["completion_tokens"]
        for e in events  # the first chunk carries the first token (and the role)
        if e.data != "[DONE]" and e.json["choices"] and "content" in e.json["choices"][0]["delta"]
    ]
    assert counts == [1, 2, 3, 4, 5, 6]
    assert events[-2].json["choices"] == [] and events[-2].json["usage"]["completion_tokens"] == 6
