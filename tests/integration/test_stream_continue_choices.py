"""A stored stream goes on where it stopped (``ChatService.resume``, the Responses resumer).

The server that produced it is gone (a crashed process's session: its row still ``running``,
its events cut short), and the stream is resumed with ``Last-Event-ID``:

- an ``n`` > 1 stream choice by choice: each unfinished choice continues after exactly its own
  tokens, a choice that had ended stays ended;
- a stream cut while ending (after its last text, between its finish chunks, before its usage
  chunk; a response between its closing events) gets only what it still owed, nothing twice.

Each time the whole answer is the one the uninterrupted stream gave.
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
        wait_for_terminal(conn, sid)
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


def wait_for_terminal(conn: sqlite3.Connection, sid: str) -> None:
    """Until the server has copied the stream's events from its journal into the table
    (within a tenth of a second of each, ``store/sqlite/store.py``)."""
    deadline = time.monotonic() + 10
    query = "SELECT 1 FROM events WHERE session_id = ? AND terminal = 1"
    while conn.execute(query, (sid,)).fetchone() is None:
        assert time.monotonic() < deadline, "the stream's events never reached the table"
        time.sleep(0.02)


def finish_index(events: list[SSEEvent], index: int) -> int:
    """Where choice ``index`` ended in ``events``."""
    return next(
        i
        for i, e in enumerate(events)
        if any(c["index"] == index and c.get("finish_reason") for c in _chunk_choices(e))
    )


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
    from vlmserve.api.common.generation import sent_by_choice
    from vlmserve.streaming import Event

    def chunk(index: int, reason: str | None = None) -> str:
        return json.dumps({"choices": [{"index": index, "delta": {}, "finish_reason": reason}]})

    events = [
        Event(0, chunk(0)),
        Event(1, chunk(1)),
        Event(2, chunk(0), meta={"token_ids": [5, 6]}),
        Event(3, chunk(1), meta={"token_ids": [7]}),
        Event(4, chunk(1, "stop"), meta={"prompt_tokens": 9, "completion_tokens": 3}),
        Event(5, chunk(0), meta={"token_ids": [8]}),
        Event(6, chunk(0, "length")),
        Event(7, json.dumps({"error": {"message": "x"}}), "error"),
        Event(8, "[DONE]"),
    ]
    sent = sent_by_choice(events)
    assert sent.tokens == {0: [5, 6, 8], 1: [7]}
    assert sent.completion == {1: 3, 0: 3}  # from the meta; else the tokens sent
    assert sent.prompt_tokens == 9 and not sent.usage_sent and sent.ended(2)
    assert not sent_by_choice(events[:5]).ended(2)
    usage_chunk = json.dumps({"choices": [], "usage": {"prompt_tokens": 9}})
    assert sent_by_choice([*events, Event(9, usage_chunk)]).usage_sent


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_cut_after_every_choice_ended_is_completed_without_generating(
    live_server: Any, tmp_path: Path, n: int
) -> None:
    """A kill between the last finish chunk and ``[DONE]``: the usage chunk (when it was not
    stored yet) and ``[DONE]`` follow, and no choice gets a token or a finish chunk more."""
    db = tmp_path / "streams.db"
    server = live_server(persist_sessions=True, sessions_db_path=str(db))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        reference, response = read_events(c, "POST", "/v1/chat/completions", json=body(n=n))
        sid = response.headers["x-session-id"]
        last_finish = max(finish_index(reference, i) for i in range(n))
        assert reference[last_finish + 1].json["usage"] and reference[-1].data == "[DONE]"
        for cut in (last_finish, last_finish + 1, last_finish + 2):  # the last finish; usage
            name = crashed_copy(db, sid, cut, f"crashed-at-{cut}")
            rest, answer = read_events(
                c, "GET", f"/v1/streams/{name}", headers={"Last-Event-ID": f"{name}:{cut - 1}"}
            )
            assert answer.status_code == 200, answer.text
            assert [e.event for e in rest if e.event == "error"] == [], rest[0].data
            whole = reference[:cut] + rest
            assert [e.data for e in whole[cut:]] == [e.data for e in reference[cut:]]
            assert choices(whole) == choices(reference)
            assert usage_of(whole) == usage_of(reference)


@pytest.mark.parametrize("closing", [0, 1, 2, 3])
def test_a_response_cut_in_its_closing_events_ends_them_without_generating(
    live_server: Any, tmp_path: Path, closing: int
) -> None:
    """The Responses API's stream cut between the closing events (after ``closing`` of them):
    the rest follow once, each as the uninterrupted stream had it, and no text is added."""
    db = tmp_path / "streams.db"
    server = live_server(persist_sessions=True, sessions_db_path=str(db))
    create = {
        "model": MODEL,
        "input": "Tell a story.",
        "max_output_tokens": 12,
        "stream": True,
        "ignore_eos": True,
    }  # sampled: without it, an early EOS may end it
    with httpx.Client(base_url=server.url, timeout=60) as c:
        reference, _ = read_events(c, "POST", "/v1/responses", json=create)
        rid = reference[0].json["response"]["id"]
        kinds = [e.event for e in reference]
        first_closing = kinds.index("response.output_text.done")
        assert kinds[first_closing:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        cut = first_closing + closing
        name = crashed_copy(db, rid, cut, f"resp_crashed{closing}")
        rest, answer = read_events(
            c, "GET", f"/v1/responses/{name}", params={"stream": "true", "starting_after": cut - 1}
        )
        assert answer.status_code == 200, answer.text
        assert [e.event for e in rest] == kinds[cut:]
        assert [e.json for e in rest] == [e.json for e in reference[cut:]]
        stored = c.get(f"/v1/responses/{name}").json()  # its record is the reference's copy
        assert stored == reference[-1].json["response"]


def flushed_tail(db: Path, sid: str) -> int | None:
    """The index of the stream's text event that carries no token (text the detokenizer held
    back, a partial character, sent with the finish), if it has one."""
    with sqlite3.connect(db) as conn:
        wait_for_terminal(conn, sid)
        rows = conn.execute(
            "SELECT idx, meta FROM events WHERE session_id = ? ORDER BY idx", (sid,)
        ).fetchall()
    for idx, meta in rows:
        stored = json.loads(meta) if meta else {}
        if stored.get("finish_reason") and stored.get("token_ids") == []:
            return int(idx)
    return None


def test_a_stream_cut_after_its_flushed_last_text_gets_only_its_finish(
    live_server: Any, tmp_path: Path
) -> None:
    """The text held back at the end (a partial character) goes out with the finish; a kill
    right after it: the resumed stream sends the finish chunk, not that text again."""
    db = tmp_path / "streams.db"
    server = live_server(persist_sessions=True, sessions_db_path=str(db))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for seed in range(40):  # random weights: some seeds end inside a character
            request = body(n=1, seed=seed, max_tokens=12)
            reference, response = read_events(c, "POST", "/v1/chat/completions", json=request)
            sid = response.headers["x-session-id"]
            if (tail := flushed_tail(db, sid)) is not None:
                break
        else:
            pytest.fail("no seed in 40 ended its stream inside a character")
        name = crashed_copy(db, sid, tail + 1, "cut-after-the-tail")
        rest, answer = read_events(
            c, "GET", f"/v1/streams/{name}", headers={"Last-Event-ID": f"{name}:{tail}"}
        )
        assert answer.status_code == 200, answer.text
        assert [e.data for e in rest] == [e.data for e in reference[tail + 1 :]]
