"""The SessionStore protocol, for the memory, SQLite and Redis stores."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from vlmserve.errors import InvalidRequest
from vlmserve.streaming import (
    Event,
    MemoryStore,
    RedisStore,
    SessionRecord,
    SessionState,
    SessionStore,
    SQLiteStore,
    build_store,
)

pytestmark = pytest.mark.timeout(30)
DONE_DATA = "[DONE]"


def record(sid: str = "s1", aliases: tuple[str, ...] = ("a1",)) -> SessionRecord:
    now = time.time()
    return SessionRecord(
        sid,
        {"model": "m", "n": [1, 2]},
        SessionState.RUNNING,
        now,
        now,
        owner="o1",
        aliases=list(aliases),
    )


def keeps_events(store: SessionStore) -> bool:
    return not isinstance(store, MemoryStore)


async def test_create_get_and_alias_lookup(any_store) -> None:
    await any_store.create(record())
    got = await any_store.get("s1")
    assert got == await any_store.get("a1")
    assert got.session_id == "s1" and got.request == {"model": "m", "n": [1, 2]}
    assert got.state is SessionState.RUNNING and got.owner == "o1" and got.aliases == ["a1"]
    assert await any_store.get("nope") is None


@pytest.mark.parametrize(
    ("sid", "aliases", "taken"),
    [("s1", (), "s1"), ("a1", (), "a1"), ("s2", ("a1",), "a1"), ("s2", ("a2", "s1"), "s1")],
)
async def test_create_rejects_a_taken_id_or_alias(any_store, sid, aliases, taken) -> None:
    await any_store.create(record())
    with pytest.raises(InvalidRequest, match=f"^session '{taken}' already exists"):
        await any_store.create(record(sid, aliases))
    assert await any_store.get("a2") is None  # nothing of a refused session is kept


async def test_append_events_state_and_heartbeat(any_store) -> None:
    await any_store.create(record())
    for i in range(5):
        await any_store.append("s1", Event(i, f"d{i}", meta={"t": [i]} if i % 2 else None))
    await any_store.append("s1", Event(5, "[DONE]", terminal=True))
    await any_store.set_state("s1", SessionState.FINISHED)
    await any_store.heartbeat("s1", "o2")
    got = await any_store.get("s1")
    assert (got.last_index, got.state, got.owner) == (5, SessionState.FINISHED, "o2")
    events = await any_store.events("s1", 2)
    if keeps_events(any_store):
        assert [e.index for e in events] == [3, 4, 5]
        assert events[0] == Event(3, "d3", meta={"t": [3]})
        assert events[-1].terminal and not events[0].terminal
        assert [e.index for e in await any_store.events("s1", -1)] == list(range(6))
    else:
        assert events == []  # persistence off: the ring buffer is the only copy


async def test_wait_events_returns_new_events_or_times_out(any_store) -> None:
    if not keeps_events(any_store):
        pytest.skip("MemoryStore keeps no events")
    await any_store.create(record())
    started = time.monotonic()
    assert await any_store.wait_events("s1", -1, 0.1) == []
    assert time.monotonic() - started >= 0.09

    async def later() -> None:
        await asyncio.sleep(0.05)
        await any_store.append("s1", Event(0, "x"))

    task = asyncio.ensure_future(later())
    events = await asyncio.wait_for(any_store.wait_events("s1", -1, 5.0), 5)
    await task
    assert [e.index for e in events] == [0]


async def test_sqlite_reopened_file_keeps_sessions_and_events(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    await store.create(record())
    await store.append("s1", Event(0, "kept"))
    await store.close()
    again = SQLiteStore(tmp_path / "x.db")
    assert (await again.get("a1")).last_index == 0
    assert await again.events("s1", -1) == [Event(0, "kept")]
    await again.close()


async def test_sqlite_file_of_the_first_schema_is_used_as_it_is(tmp_path) -> None:
    """Files written before the events table had a rowid: kept, read and appended to, and a
    second event of one index does not replace the first there either."""
    with sqlite3.connect(tmp_path / "old.db") as conn:
        conn.execute(
            "CREATE TABLE events (session_id TEXT NOT NULL, idx INTEGER NOT NULL, event TEXT, "
            "data TEXT NOT NULL, meta TEXT, terminal INTEGER NOT NULL DEFAULT 0, "
            "PRIMARY KEY (session_id, idx)) WITHOUT ROWID"
        )
        conn.execute("INSERT INTO events VALUES ('s1', 0, NULL, 'old', NULL, 0)")
    store = SQLiteStore(tmp_path / "old.db")
    await store.create(record())
    await store.append("s1", Event(1, "new"))
    assert await store.events("s1", -1) == [Event(0, "old"), Event(1, "new")]
    await store.append("s1", Event(1, "again"))  # a journal replayed twice: the first is kept
    assert await store.events("s1", -1) == [Event(0, "old"), Event(1, "new")]
    assert (await store.get("a1")).last_index == 1
    await store.close()
    with sqlite3.connect(tmp_path / "old.db") as conn:
        indexes = conn.execute(
            "SELECT name FROM sqlite_master WHERE tbl_name = 'events' "
            "AND type = 'index' AND sql IS NOT NULL"
        ).fetchall()
    assert indexes == []  # no second index on a table keyed by (session_id, idx) already


async def test_sqlite_many_concurrent_appends_are_all_committed(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    await asyncio.gather(*(store.create(record(f"s{i}", ())) for i in range(20)))

    async def write(sid: str) -> None:
        for i in range(25):
            await store.append(sid, Event(i, str(i)))

    await asyncio.gather(*(write(f"s{i}") for i in range(20)))
    for i in range(20):
        assert [e.index for e in await store.events(f"s{i}", -1)] == list(range(25))
    await store.close()


async def test_memory_gc_drops_expired_records() -> None:
    store = MemoryStore(ttl=10)
    await store.create(record())
    assert await store.gc() == 0
    assert await store.gc(now=time.time() + 11) == 1
    assert await store.get("s1") is None and await store.get("a1") is None


async def test_redis_keys_expire_after_ttl_refreshed_on_append(redis_store) -> None:
    await redis_store.create(record())
    await redis_store.append("s1", Event(0, "x"))
    client = redis_store._redis
    for kind, name in (("session", "s1"), ("events", "s1"), ("alias", "a1")):
        ttl = await client.ttl(f"{redis_store.prefix}:{kind}:{name}")
        assert 0 < ttl <= 60


async def _calls(client, command: str) -> int:
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_redis_an_event_is_one_xadd_and_the_record_is_refreshed_once_a_second(
    redis_store,
) -> None:
    """A burst of appends writes each event, refreshes the session hash only with the first
    (and the terminal) one, and ``get`` still reads the newest index at once."""
    client = redis_store._redis
    await redis_store.create(record())
    xadds, hsets = await _calls(client, "xadd"), await _calls(client, "hset")
    for i in range(20):
        await redis_store.append("s1", Event(i, str(i)))
    assert await _calls(client, "xadd") - xadds == 20
    assert await _calls(client, "hset") - hsets == 1  # the first append's refresh only
    assert (await redis_store.get("a1")).last_index == 19  # from the stream, not the hash
    assert await client.hget(f"{redis_store.prefix}:session:s1", "last_index") == "0"
    await redis_store.append("s1", Event(20, DONE_DATA, terminal=True))
    assert await client.hget(f"{redis_store.prefix}:session:s1", "last_index") == "20"
    await redis_store.set_state("s1", SessionState.FINISHED)
    assert "s1" not in redis_store._touched and "s1" not in redis_store._aliases
    assert (await redis_store.get("s1")).state is SessionState.FINISHED


async def test_redis_appends_after_a_second_refresh_the_session_again(redis_store) -> None:
    client = redis_store._redis
    await redis_store.create(record())
    await redis_store.append("s1", Event(0, "x"))
    before = float(await client.hget(f"{redis_store.prefix}:session:s1", "updated_at"))
    redis_store._touched["s1"] -= 1.0  # as if the last refresh were a second older
    await redis_store.append("s1", Event(1, "y"))
    after = float(await client.hget(f"{redis_store.prefix}:session:s1", "updated_at"))
    assert after > before
    assert await client.hget(f"{redis_store.prefix}:session:s1", "last_index") == "1"


async def test_redis_rejects_a_duplicate_index(redis_store) -> None:
    await redis_store.create(record())
    await redis_store.append("s1", Event(0, "x"))
    with pytest.raises(Exception, match="equal or smaller"):
        await redis_store.append("s1", Event(0, "again"))


async def test_build_store_picks_redis_then_sqlite_then_memory(tmp_path) -> None:
    memory = build_store(persist=False)
    sqlite = build_store(persist=True, db_path=tmp_path / "b.db", ttl=5)
    redis = build_store(persist=True, redis_url="redis://127.0.0.1:1/0")
    assert isinstance(memory, MemoryStore) and isinstance(sqlite, SQLiteStore)
    assert isinstance(redis, RedisStore) and redis.shared and not sqlite.shared
    for store in (memory, sqlite, redis):
        await store.close()


# -- MemoryStore details --------------------------------------------------------------------


def old_record(sid: str = "s1", aliases: tuple[str, ...] = ("a1",), at: float = 1000.0):
    return SessionRecord(sid, {}, SessionState.RUNNING, at, at, owner="o1", aliases=list(aliases))


def test_memory_store_is_private_to_one_process_and_keeps_records_ten_minutes() -> None:
    assert MemoryStore.shared is False  # no other replica can cancel or take over its sessions
    assert MemoryStore().ttl == 600.0


async def test_memory_store_gc_frees_the_aliases_of_expired_sessions() -> None:
    store = MemoryStore(ttl=10)
    await store.create(old_record("s1", ("a1", "a2")))
    await store.create(old_record("s2", ("b1",), at=time.time()))
    assert await store.gc(now=1000.0 + 10) == 0  # exactly ttl old: kept
    assert await store.gc(now=1000.0 + 10.5) == 1
    assert await store.get("s1") is None and await store.get("a2") is None
    await store.create(old_record("s3", ("a1", "a2")))  # the freed aliases can be used again
    assert (await store.get("a2")).session_id == "s3"
    assert (await store.get("b1")).session_id == "s2"  # others untouched


async def test_memory_store_writes_refresh_updated_at_so_gc_keeps_live_sessions() -> None:
    store = MemoryStore(ttl=10)
    for sid in ("s1", "s2", "s3"):
        await store.create(old_record(sid, ()))
    await store.append("s1", Event(0, "x"))
    await store.set_state("s2", SessionState.FINISHED)
    await store.heartbeat("s3", "o2")
    assert await store.gc(now=time.time()) == 0
    for sid in ("s1", "s2", "s3"):
        assert time.time() - (await store.get(sid)).updated_at < 5
    assert (await store.get("s3")).owner == "o2"


async def test_memory_store_last_index_only_grows() -> None:
    store = MemoryStore()
    await store.create(old_record())
    await store.append("s1", Event(5, "x"))
    await store.append("s1", Event(3, "late"))
    assert (await store.get("s1")).last_index == 5


async def test_memory_store_writes_to_unknown_sessions_are_ignored() -> None:
    store = MemoryStore()
    await store.append("nope", Event(0, "x"))
    await store.set_state("nope", SessionState.FINISHED)
    await store.heartbeat("nope", "o2")
    assert await store.get("nope") is None


async def test_memory_store_hands_out_copies() -> None:
    store = MemoryStore()
    original = SessionRecord("s1", {"n": [1]}, SessionState.RUNNING, 1.0, 1.0, aliases=["a1"])
    await store.create(original)
    original.request["n"] = "changed"
    original.aliases.append("a2")
    got = await store.get("s1")
    assert got.request == {"n": [1]} and got.aliases == ["a1"]
    got.request["x"] = 1
    got.aliases.clear()
    got.state = SessionState.FAILED
    again = await store.get("a1")
    assert again.request == {"n": [1]} and again.aliases == ["a1"]
    assert again.state is SessionState.RUNNING


async def test_memory_store_wait_events_blocks_for_the_timeout() -> None:
    """A follower polls with wait_events; returning at once would make it spin."""
    store = MemoryStore()
    await store.create(old_record())
    started = time.monotonic()
    assert await store.wait_events("s1", -1, 0.1) == []
    assert time.monotonic() - started >= 0.09


async def test_memory_store_close_forgets_everything() -> None:
    store = MemoryStore()
    await store.create(old_record())
    await store.close()
    assert await store.get("s1") is None and await store.get("a1") is None
    await store.create(old_record())  # id and alias are free again


async def test_memory_store_names_the_taken_id_or_alias() -> None:
    store = MemoryStore()
    await store.create(old_record("s1", ("a1",)))
    for sid, aliases, taken in (("s1", (), "s1"), ("s2", ("a2", "a1"), "a1")):
        with pytest.raises(InvalidRequest, match=f"^session '{taken}' already exists"):
            await store.create(old_record(sid, aliases))
    assert await store.get("a2") is None  # nothing of a refused session is kept
