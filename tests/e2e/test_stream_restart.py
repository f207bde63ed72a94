"""Streams survive kill -9 (SQLite) and move between server processes (Redis)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from sse_client import SSEEvent, read_events, text_of, without_token
from support import ServerProcess
from vlmserve.streaming.store.sqlite.journal import read_rows

pytestmark = pytest.mark.slow
TOKENS = 300


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "temperature": 0,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def serve_args(tiny_dir: Path) -> list[str]:
    return ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]


def start(tiny_dir: Path, env: dict[str, str]) -> ServerProcess:
    server = ServerProcess(serve_args(tiny_dir), env)
    server.wait_ready()
    return server


def assert_complete(events: list[SSEEvent]) -> None:
    assert [e.index for e in events] == list(range(len(events)))
    assert events[-1].data == "[DONE]"


def persisted(db: Path, session_id: str) -> int:
    """Events of the session a killed server left: in the table or still in its journal."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT idx FROM events WHERE session_id = ?", (session_id,))
        indexes = {idx for (idx,) in rows}
    for journal in db.parent.glob(f"{db.name}.events-*.jsonl"):
        indexes |= {row[1] for row in read_rows(journal) if row[0] == session_id}
    return len(indexes)


# Greedy, and sampled at temperature 1 with a seed: a restarted server continues both exactly,
# the sampled one because its row's generator is advanced past the tokens already sent.
CASES = {"greedy": {}, "seeded temperature 1": {"temperature": 1.0, "seed": 20261125}}


@pytest.mark.timeout(1200)  # 4 (20) server restarts, each loading the model
def test_kill_9_mid_stream_then_restart_continues_the_generation(
    tiny_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    long = request.config.getoption("--long")
    trials = 20 if long else 4  # release checks: 20 kills
    db = tmp_path / "streams.db"
    env = {
        "VLMSERVE_PERSIST_SESSIONS": "1",
        "VLMSERVE_SESSIONS_DB_PATH": str(db),
        "VLMSERVE_ENGINE_PROCESS": "1" if long else "0",
    }  # release checks: the default
    server = start(tiny_dir, env)
    rng = random.Random(20261122)
    mid_generation = 0
    try:
        expected = {}
        for name, extra in CASES.items():
            with httpx.Client(base_url=server.url, timeout=120) as c:
                reference, _ = read_events(c, "POST", "/v1/chat/completions", json=body(**extra))
            expected[name] = (text_of(reference), len(reference))
        assert len(set(text for text, _ in expected.values())) == len(CASES)  # really sampled
        for trial in range(trials):
            name = list(CASES)[trial % len(CASES)]
            k = rng.randint(1, 40)
            with httpx.Client(base_url=server.url, timeout=120) as c:
                first, response = read_events(
                    c, "POST", "/v1/chat/completions", json=body(**CASES[name]), limit=k
                )
            sid = response.headers["x-session-id"]
            server.proc.kill()  # kill -9: no clean shutdown, no flush
            server.proc.wait()
            mid_generation += persisted(db, sid) < expected[name][1]
            server = start(tiny_dir, env)
            with httpx.Client(base_url=server.url, timeout=120) as c:
                rest, _ = read_events(
                    c, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": first[-1].id}
                )
            assert_complete(first + rest)  # no event lost, none twice
            assert text_of(first + rest) == expected[name][0], (
                f"trial {trial} ({name}), killed after {k} events"
            )
    finally:
        server.stop()
    landed = 16 if long else 3  # of 20 (4)
    assert mid_generation >= landed, "the kills should land while the engine generates"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_stream_started_on_one_process_resumes_on_another_via_redis(
    tiny_dir: Path, redis_url: str
) -> None:
    env = {"VLMSERVE_REDIS_URL": redis_url}
    a, b = start(tiny_dir, env), start(tiny_dir, env)
    try:
        with httpx.Client(base_url=a.url, timeout=120) as c:
            reference, _ = read_events(c, "POST", "/v1/chat/completions", json=body())
            first, response = read_events(c, "POST", "/v1/chat/completions", json=body(), limit=5)
        sid = response.headers["x-session-id"]
        with httpx.Client(base_url=b.url, timeout=120) as c:
            rest, _ = read_events(
                c, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": first[-1].id}
            )
            replay, _ = read_events(c, "GET", f"/v1/streams/{reference[0].id.split(':')[0]}")
    finally:
        a.stop()
        b.stop()
    assert_complete(first + rest)
    assert text_of(first + rest) == text_of(reference)
    assert [e.data for e in replay] == [without_token(e.data) for e in reference]
