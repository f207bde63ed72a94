"""What each stream store costs per event, in process, with no model and no HTTP.

    python benchmarks/stores.py                      # memory and sqlite, 3 rounds
    python benchmarks/stores.py --redis              # and Redis (starts a redis-server)
    python benchmarks/stores.py --sessions 8 --events 64 --step-ms 2 --rounds 5

``SessionManager`` runs ``--sessions`` streams at once, each producing ``--events`` events one
engine step apart (``--step-ms``, all sessions in step, as the batching engine produces them),
each read by one listener. Reported per store: process CPU time (all threads: the SQLite
writer's too, closing the store included) per event, wall time, and the store's transactions
(SQLite: copies of its journal into the table; Redis: pipelined writes). The stores take turns
round by round. This is the part of ``benchmarks/overhead.py``'s sqlite-vs-memory cost that
belongs to the store and the session machinery, without the engine and the HTTP path.
Also reported: what one thread hop (``run_in_executor`` of a no-op) costs on this machine.

``--gil`` measures instead what copying the journal into SQLite costs beside a busy Python
thread (the event loop under load): 40 copies of 272 events (8 sessions x 34 steps), one
``INSERT`` statement per event (``executemany``, the earlier copy) against the
store's own copy (``sqlite_copy.copy_entries``: multi-row INSERTs). SQLite releases the GIL
around each statement; beside a busy thread each release is a hand-over of the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlmserve.streaming.events import Emit
from vlmserve.streaming.manager import SessionManager
from vlmserve.streaming.store.memory import MemoryStore
from vlmserve.streaming.store.sqlite import SQLiteStore
from vlmserve.streaming.store.sqlite.copy import copy_entries

DATA = json.dumps(
    {
        "id": "chatcmpl-b",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
    }
)


async def one_round(store: Any, ns: argparse.Namespace, tag: str) -> dict[str, float]:
    manager = SessionManager(store, gc_interval=3600)  # the server's other defaults
    step = asyncio.Event()

    async def producer() -> Any:
        for i in range(ns.events):
            await step.wait()
            yield Emit(DATA, meta={"token_ids": [i]})

    async def engine() -> None:
        for _ in range(ns.events + 1):
            await asyncio.sleep(ns.step_ms / 1000)
            step.set()
            step.clear()

    async def listen(session_id: str) -> int:
        return sum([1 async for _ in manager.listen(session_id, -1)])

    wall = time.perf_counter()
    ids = [f"{tag}-{k}" for k in range(ns.sessions)]
    for session_id in ids:
        await manager.start(
            session_id, {"body": {}}, producer(), on_cancel=list, on_error=lambda exc: []
        )
    ticking = asyncio.ensure_future(engine())
    events = sum(await asyncio.gather(*(listen(s) for s in ids)))
    ticking.cancel()
    wall = time.perf_counter() - wall
    await manager.close()
    return {"wall_s": wall, "events": events}


def hop_us(n: int = 2000) -> float:
    """CPU microseconds of one ``run_in_executor`` round trip of a no-op."""

    async def hops() -> float:
        loop, pool = asyncio.get_running_loop(), ThreadPoolExecutor(1)
        began = time.process_time()
        for _ in range(n):
            await loop.run_in_executor(pool, int)
        pool.shutdown()
        return (time.process_time() - began) / n * 1e6

    return asyncio.run(hops())


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("--redis needs the redis-server binary")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [server, "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def make_store(name: str, work: Path, redis_url: str | None) -> Any:
    if name == "memory":
        return MemoryStore()
    if name == "sqlite":
        return SQLiteStore(work / "sessions.db")
    from vlmserve.streaming.store.redis import RedisStore

    return RedisStore(redis_url or "", prefix=f"bench-{time.time_ns()}")


async def close_store(store: Any) -> None:
    for name in ("aclose", "close"):
        closer = getattr(store, name, None)
        if closer is not None:
            result = closer()
            if asyncio.iscoroutine(result):
                await result
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--events", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--redis", action="store_true", help="also Redis (starts a redis-server)")
    p.add_argument("--gil", action="store_true", help="the journal copy beside a busy thread")
    ns = p.parse_args(argv)
    if ns.gil:
        return gil_check()
    names = ["memory", "sqlite"] + (["redis"] if ns.redis else [])
    redis, redis_url = start_redis() if ns.redis else (None, None)
    print(f"one thread hop: {hop_us():.0f} us CPU")
    try:
        with tempfile.TemporaryDirectory(prefix="vlmserve-stores-") as work:
            for r in range(ns.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    store = make_store(name, Path(work), redis_url)
                    out = asyncio.run(_measured(store, ns, f"r{r}-{name}"))
                    cost = f"{out['cpu_us_per_event']:6.0f} us CPU/event"
                    print(
                        f"round {r + 1} {name:<7} {cost}  wall {out['wall_s']:.3f} s"
                        f"  transactions {out['copies']}"
                    )
    finally:
        if redis is not None:
            redis.terminate()
    return 0


def gil_check(copies: int = 40, steps: int = 34, sessions: int = 8) -> int:
    """Print the CPU (copying thread) and wall time per event of the two ways to copy, alone
    and beside a thread that runs Python without pause."""
    rows = [
        (f"chatcmpl-{s:024x}", i, None, DATA, '{"token_ids":[1]}', 0)
        for i in range(copies * steps)
        for s in range(sessions)
    ]
    batch = steps * sessions
    for busy in (False, True):
        for name, copy in (("one INSERT per event", _per_event), ("copy_entries", _copy_all)):
            cpu, wall = _timed_copies(copy, rows, batch, busy)
            print(
                f"{'busy thread beside' if busy else 'alone':<18} {name:<21} "
                f"{cpu:7.1f} us CPU/event  {wall:8.1f} us wall/event"
            )
    return 0


def _per_event(conn: sqlite3.Connection, rows: list[Any]) -> None:
    with conn:
        conn.executemany("INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?)", rows)


def _copy_all(conn: sqlite3.Connection, rows: list[Any]) -> None:
    copy_entries(conn, rows, [])


def _timed_copies(copy: Any, rows: list[Any], batch: int, busy: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="vlmserve-gil-") as work:
        store = SQLiteStore(Path(work) / "s.db")  # the store's schema and pragmas
        conn, stop = store._conn, threading.Event()
        spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
        if busy:
            spinner.start()
        cpu, wall = 0.0, time.perf_counter()
        for start in range(0, len(rows), batch):
            began = time.thread_time()
            copy(conn, rows[start : start + batch])
            cpu += time.thread_time() - began
        wall = time.perf_counter() - wall
        stop.set()
        if busy:
            spinner.join()
        asyncio.run(store.close())
    return cpu / len(rows) * 1e6, wall / len(rows) * 1e6


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


async def _measured(store: Any, ns: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One round's figures; its CPU includes closing the store (SQLite copies the rest of its
    journal into the table then)."""
    cpu = time.process_time()
    try:
        out: dict[str, Any] = await one_round(store, ns, tag)
    finally:
        await close_store(store)
    out["cpu_us_per_event"] = (time.process_time() - cpu) / out["events"] * 1e6
    if isinstance(store, SQLiteStore):  # copies of its journal into the events table
        out["copies"] = store.flushes
    else:
        group = getattr(store, "_appends", None)  # Redis's pipelined writes
        out["copies"] = group.writes if group is not None else "-"
    return out


if __name__ == "__main__":
    sys.exit(main())
