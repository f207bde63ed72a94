"""A stored ``n`` > 1 stream goes on choice by choice where it stopped (``ChatService.resume``).

The server that produced it is gone (a crashed process's session: its row still ``running``,
its events cut short), and the stream is resumed with ``Last-Event-ID``: each unfinished
choice continues after exactly its own tokens, a choice that had ended stays ended, and the
whole answer is the one the uninterrupted stream gave.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sse_client import SSEEvent, read_events
from sse_client import texts_by_choice as choices
from support import MODEL

pytestmark = pytest.mark.timeout(120)


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a story about the sea."}],
        "n": 2,
        "temperature": 1.0,
        "seed": 1234,
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def _chunk_choices(event: SSEEvent) -> list[dict[str, Any]]:
    if event.data == "[DONE]" or event.event == "error":
        return []
    return list(event.json.get("choices") or [])


def usage_of(events: list[SSEEvent]) -> dict[str, int]:
    found = [e.json["usage"] for e in events if e.data != "[DONE]" and e.json.get("usage")]
    assert len(found) == 1, "one usage chunk, after every choice ended"
    return found[0]


def crashed_copy(db: Path, sid: str, cut: int, name: str) -> str:
    """A copy of session ``sid`` as a killed server leaves it: still running, ``cut`` events."""
    with sqlite3.connect(db) as conn:
        (request,) = conn.execute(
            "SELECT request FROM sessions WHERE session_id = ?", (sid,)
        ).fetchone()
        now = time.time()
        conn.execute(
            "INSERT INTO sessions VALUES (?, ?, 'running', ?, ?, ?, 'a-killed-server')",
            (name, request, now, now, cut - 1),
        )
        conn.execute(
            "INSERT INTO events SELECT ?, idx, event, data, meta, terminal FROM events "
            "WHERE session_id = ? AND idx < ?",
            (name, sid, cut),
        )
    return name


def finish_index(events: list[SSEEvent], index: int) -> int:
    """Where choice ``index`` ended in ``events``."""
    return next(
        i for i, e in enumerate(events)
        if any(c["index"] == index and c.get("finish_reason") for c in _chunk_choices(e))
    )  # fmt: skip


def stop_for_choice_0(c: httpx.Client) -> str:
    """A stop string that ends choice 0 early and never occurs in choice 1 (the choices are
    sampled with seeds 1234 and 1235, so this is the same string on every run)."""
    events, _ = read_events(c, "POST", "/v1/chat/completions", json=body())
    first, second = choices(events)[0][0], choices(events)[1][0]
    for start in range(2, len(first) - 3):
        stop = first[start : start + 3]
        if stop.strip() and stop not in second and stop not in first[:start]:
            return stop
    raise AssertionError(f"no usable stop string in {first!r} / {second!r}")


def test_a_stored_two_choice_stream_continues_choice_by_choice(
    live_server: Any, tmp_path: Path
) -> None:
    db = tmp_path / "streams.db"
    server = live_server(persist_sessions=True, sessions_db_path=str(db))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        stop = stop_for_choice_0(c)
        reference, response = read_events(c, "POST", "/v1/chat/completions", json=body(stop=stop))
        sid = response.headers["x-session-id"]
        ended = finish_index(reference, 0)
        assert choices(reference)[0][1] == "stop" and choices(reference)[1][1] == "length"
        assert ended < finish_index(reference, 1) - 2, "choice 0 should end well before choice 1"
        for cut in (3, ended - 1, ended + 2):  # both running; choice 0 about to end; it ended
            name = crashed_copy(db, sid, cut, f"crashed-at-{cut}")
            rest, answer = read_events(
                c, "GET", f"/v1/streams/{name}", headers={"Last-Event-ID": f"{name}:{cut - 1}"}
            )
            assert answer.status_code == 200, answer.text
            whole = reference[:cut] + rest
            assert [e.index for e in rest] == list(range(cut, cut + len(rest)))
            assert whole[-1].data == "[DONE]"
            assert choices(whole) == choices(reference), f"cut after {cut} events"
            assert usage_of(whole) == usage_of(reference)


def test_sent_by_choice_reads_each_choices_tokens_and_ends() -> None:
    from vlmserve.api.serving.generation import sent_by_choice
    from vlmserve.streaming import Event

    def chunk(index: int, reason: str | None = None) -> str:
        return json.dumps({"choices": [{"index": index, "delta": {}, "finish_reason": reason}]})

    events = [
        Event(0, chunk(0)), Event(1, chunk(1)),
        Event(2, chunk(0), meta={"token_ids": [5, 6]}), Event(3, chunk(1), meta={"token_ids": [7]}),
        Event(4, chunk(1, "stop")), Event(5, chunk(0), meta={"token_ids": [8]}),
        Event(6, json.dumps({"error": {"message": "x"}}), "error"), Event(7, "[DONE]"),
    ]  # fmt: skip
    assert sent_by_choice(events) == ({0: [5, 6, 8], 1: [7]}, {1})
