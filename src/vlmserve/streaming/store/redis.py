"""RedisStore: one store shared by several server processes (gateway replicas).

Keys (``P`` = prefix):
    P:session:<id>   hash   the SessionRecord (request and aliases as JSON)
    P:events:<id>    stream one entry per event, entry id ``<index + 1>-0``: exact reads by index
    P:alias:<alias>  string the session id
Every key expires ``ttl`` seconds after the session's last append, state change or heartbeat.
``wait_events`` blocks in ``XREAD BLOCK`` so followers in other processes see events at once.
A cancel is also published on ``P:cancels`` (pub/sub), so the replica producing the stream
stops at once instead of at its next heartbeat (``cancels``).
Appends are group-committed (``store/group.py``): the events that queue while one MULTI/EXEC
runs go out together in the next, one round trip for all of them. An event is one ``XADD``;
its session's ``updated_at`` and the keys' TTLs are refreshed with it at most once a second
(and always with the first and the terminal event), and ``last_index`` is read back from the
stream's newest entry. Before, each event also carried an ``HSET`` and an ``EXPIRE`` per key,
five commands or more: ``benchmarks/stores.py --redis`` measured 219-230 us of CPU per event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis

from vlmserve.streaming.events import FINAL_STATES, Event, SessionRecord, SessionState
from vlmserve.streaming.store.base import already_exists, dump_meta, dump_request, load_meta
from vlmserve.streaming.store.group import GroupCommit

if TYPE_CHECKING:
    from redis.typing import EncodableT

__all__ = ["RedisStore"]


def _entry_id(index: int) -> str:
    # Stream ids must be > 0-0, so index i is stored as "<i + 1>-0".
    return f"{index + 1}-0"


class RedisStore:
    shared = True

    def __init__(self, url: str, ttl: float = 600.0, prefix: str = "vlmserve") -> None:
        self.url = url
        self.ttl = ttl
        self.prefix = prefix
        self._ttl_s = max(1, int(ttl))
        self._redis = aioredis.from_url(url, decode_responses=True)
        self._aliases: dict[str, list[str]] = {}  # session id -> aliases, to refresh their TTL
        self._appends: GroupCommit[tuple[str, Event]] = GroupCommit(self._append_batch)
        self._touched: dict[str, float] = {}  # session id -> when an append last refreshed it
        self._touch_every = min(1.0, self._ttl_s / 4)  # seconds between those refreshes

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:{kind}:{name}"

    async def create(self, record: SessionRecord) -> None:
        sid = record.session_id
        key = self._key("session", sid)
        if await self._redis.exists(self._key("alias", sid)):
            raise already_exists(sid)
        if not await self._redis.hsetnx(key, "session_id", sid):
            raise already_exists(sid)
        taken: list[str] = []
        for alias in record.aliases:  # neither another session's id nor its alias
            if await self._redis.exists(self._key("session", alias)) or not await self._redis.set(
                self._key("alias", alias), sid, nx=True, ex=self._ttl_s
            ):
                await self._redis.delete(key, *(self._key("alias", a) for a in taken))
                raise already_exists(alias)
            taken.append(alias)
        mapping: dict[EncodableT, EncodableT] = {
            "request": dump_request(record.request),
            "state": record.state.value,
            "created_at": repr(record.created_at),
            "updated_at": repr(record.updated_at),
            "last_index": str(record.last_index),
            "owner": record.owner,
            "aliases": json.dumps(record.aliases),
        }
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, self._ttl_s)
            await pipe.execute()
        self._aliases[sid] = list(record.aliases)

    async def _alias_keys(self, session_id: str) -> list[str]:
        aliases = self._aliases.get(session_id)
        if aliases is None:
            raw = await self._redis.hget(self._key("session", session_id), "aliases")
            aliases = self._aliases[session_id] = json.loads(raw) if raw else []
        return [self._key("alias", a) for a in aliases]

    async def _touch(self, session_id: str, fields: dict[str, str], event: Event | None) -> None:
        """Atomically: update record fields (+ updated_at), add an event, refresh every TTL."""
        await self._alias_keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            self._queue_touch(pipe, session_id, fields, event)
            await pipe.execute()

    def _queue_touch(
        self, pipe: Any, session_id: str, fields: dict[str, str], event: Event | None
    ) -> None:
        key = self._key("session", session_id)
        stream = self._key("events", session_id)
        alias_keys = [self._key("alias", a) for a in self._aliases.get(session_id, [])]
        if event is not None:
            pipe.xadd(stream, _event_fields(event), id=_entry_id(event.index))
        pipe.hset(key, mapping={**fields, "updated_at": repr(time.time())})
        for name in (key, stream, *alias_keys):
            pipe.expire(name, self._ttl_s)

    async def append(self, session_id: str, event: Event) -> None:
        await self._alias_keys(session_id)  # known before the batch is written
        await self._appends.submit((session_id, event))

    async def _append_batch(self, items: list[tuple[str, Event]]) -> list[BaseException | None]:
        """Group commit: every queued event in one MULTI/EXEC (one round trip, applied
        together); an event whose command fails (a duplicate index) fails only its append."""
        spans: list[int] = []
        now = time.monotonic()
        async with self._redis.pipeline(transaction=True) as pipe:
            for session_id, event in items:
                before = len(pipe.command_stack)
                if self._due(session_id, event, now):
                    self._queue_touch(pipe, session_id, {"last_index": str(event.index)}, event)
                else:
                    pipe.xadd(
                        self._key("events", session_id),
                        _event_fields(event),
                        id=_entry_id(event.index),
                    )
                spans.append(len(pipe.command_stack) - before)
            results = await pipe.execute(raise_on_error=False)
        out: list[BaseException | None] = []
        at = 0
        for span in spans:
            errors = [r for r in results[at : at + span] if isinstance(r, Exception)]
            out.append(errors[0] if errors else None)
            at += span
        return out

    def _due(self, session_id: str, event: Event, now: float) -> bool:
        """Whether this append refreshes the session (``updated_at``, TTLs, ``last_index``):
        its first, its terminal, and then one a ``_touch_every``."""
        last = self._touched.get(session_id)
        if event.terminal or last is None or now - last >= self._touch_every:
            self._touched[session_id] = now
            return True
        return False

    async def set_state(self, session_id: str, state: SessionState) -> None:
        await self._touch(session_id, {"state": state.value}, None)
        if state is SessionState.CANCELLED:  # its producer may be another process: tell it
            await self._redis.publish(self._key("cancels", "all"), session_id)
        if state in FINAL_STATES:  # its appends are over: forget what they needed
            self._touched.pop(session_id, None)
            self._aliases.pop(session_id, None)

    async def heartbeat(self, session_id: str, owner: str) -> None:
        await self._touch(session_id, {"owner": owner}, None)

    async def get(self, session_id: str) -> SessionRecord | None:
        data, newest = await self._record(session_id)
        if "state" not in data:
            target = cast("str | None", await self._redis.get(self._key("alias", session_id)))
            if target is None:
                return None
            data, newest = await self._record(target)
            if "state" not in data:
                return None
        return SessionRecord(
            session_id=data["session_id"],
            request=json.loads(data["request"]),
            state=SessionState(data["state"]),
            created_at=float(data["created_at"]),
            updated_at=float(data["updated_at"]),
            last_index=max(int(data["last_index"]), newest),
            owner=data["owner"],
            aliases=json.loads(data["aliases"]),
        )

    async def _record(self, session_id: str) -> tuple[dict[str, str], int]:
        """The session's hash and the index of its newest stored event (-1: none), in one
        round trip (appends refresh the hash's ``last_index`` only once a second)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._key("session", session_id))
            pipe.xrevrange(self._key("events", session_id), count=1)
            data, newest = await pipe.execute()
        return data, int(newest[0][0].split("-")[0]) - 1 if newest else -1

    async def events(self, session_id: str, after: int) -> list[Event]:
        stream = self._key("events", session_id)
        entries = cast(
            "list[tuple[str, dict[str, str]]]",
            await self._redis.xrange(stream, min=_entry_id(after + 1)),
        )
        return [_to_event(fields) for _, fields in entries]

    async def wait_events(self, session_id: str, after: int, timeout: float) -> list[Event]:
        stream = self._key("events", session_id)
        block_ms = max(1, int(timeout * 1000))  # BLOCK 0 would mean "forever"
        reply = await self._redis.xread({stream: _entry_id(after)}, block=block_ms)
        # The reply's shape differs between RESP2, RESP3 and redis-py versions; read the new
        # entries back with XRANGE, which is exact and shape-stable.
        return await self.events(session_id, after) if reply else []

    async def cancels(self) -> AsyncIterator[str]:
        """The ids of sessions cancelled from now on, by any process on this store."""
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._key("cancels", "all"))
            async for message in pubsub.listen():
                if message is not None and message.get("type") == "message":
                    yield str(message["data"])
        finally:
            await pubsub.aclose()

    async def gc(self, now: float | None = None) -> int:
        return 0  # every key carries an EXPIRE; Redis drops expired sessions itself

    async def close(self) -> None:
        await self._redis.aclose()


def _event_fields(event: Event) -> dict[EncodableT, EncodableT]:
    fields: dict[EncodableT, EncodableT] = {
        "i": event.index,
        "d": event.data,
        "t": int(event.terminal),
    }
    if event.event is not None:
        fields["e"] = event.event
    meta = dump_meta(event.meta)
    if meta is not None:
        fields["m"] = meta
    return fields


def _to_event(fields: dict[str, str]) -> Event:
    return Event(
        index=int(fields["i"]),
        data=fields["d"],
        event=fields.get("e"),
        meta=load_meta(fields.get("m")),
        terminal=fields.get("t") == "1",
    )
