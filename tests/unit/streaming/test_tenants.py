"""Sessions per tenant (an API key's digest): names, aliases, lookups and cancels in one
tenant's namespace never reach another's, in every store; secret aliases (a resume token's
digest) are in no namespace. And a listener ahead of the producer waits for its events."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vlmserve.errors import InvalidRequest, NotFound
from vlmserve.streaming import SessionManager, SessionState, SQLiteStore
from vlmserve.streaming.scope import scoped, unscoped

pytestmark = pytest.mark.timeout(30)

KA, KB = "key-" + "a" * 32, "key-" + "b" * 32


def test_a_scoped_name_holds_its_tenant_and_gives_back_the_clients_name() -> None:
    assert scoped("", "abc") == "abc" and unscoped("abc") == "abc"  # no keys: as before
    assert scoped(KA, "abc") == f"{KA}/abc" != scoped(KB, "abc")
    assert unscoped(scoped(KA, "chatcmpl-1")) == "chatcmpl-1"
    assert unscoped(scoped(KA, "a/b")) == "a/b"  # a resumed name is the client's, as given


async def test_one_tenants_session_is_unknown_to_another(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    mine = await manager.start(
        "s1",
        {},
        producer(5000, delay=0.001, every=50),
        **callbacks,
        aliases=["chatcmpl-1"],
        tenant=KA,
    )
    for name in ("s1", "chatcmpl-1"):
        assert manager.get(name, KA) is mine and manager.get(name, KB) is None
        assert manager.get(name) is None  # nor the namespace of "no keys"
        assert await manager.exists(name, KA) and not await manager.exists(name, KB)
        with pytest.raises(NotFound) as caught:
            await manager.listen(name, -1, KB)
        assert name in caught.value.message and KB not in caught.value.message
        assert not await manager.cancel(name, KB)
    assert mine.running
    theirs = await manager.start("s1", {}, producer(3), **callbacks, tenant=KB)  # the same name
    assert theirs is not mine and theirs.session_id == scoped(KB, "s1")
    with pytest.raises(InvalidRequest, match="already exists"):
        await manager.start("s1", {}, producer(3), **callbacks, tenant=KA)
    events = await asyncio.wait_for(drain(manager.listen("s1", -1, KB)), 10)
    assert len(events) == 4  # B's three events and [DONE], not A's
    assert await manager.cancel("chatcmpl-1", KA)
    await asyncio.wait_for(mine.wait(), 10)
    assert (await any_store.get(scoped(KA, "s1"))).state is SessionState.CANCELLED
    assert await any_store.get("s1") is None
    await manager.close()


async def test_a_secret_alias_is_found_in_no_namespace_but_its_own(
    any_store, producer, callbacks
) -> None:
    manager = SessionManager(any_store)
    session = await manager.start(
        "s1", {}, producer(3), **callbacks, tenant=KA, secret_aliases=["rt-" + "f" * 64]
    )
    await session.wait()
    record = await manager.record("rt-" + "f" * 64)
    assert record is not None and record.session_id == scoped(KA, "s1")
    assert await manager.record("rt-" + "f" * 64, KA) is None  # not a name of A's namespace
    assert (await any_store.get("rt-" + "f" * 64)).session_id == scoped(KA, "s1")
    await manager.close()


async def test_names_stay_per_tenant_after_the_store_is_reopened(
    tmp_path: Path, producer, callbacks, drain
) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    manager = SessionManager(store)
    await (await manager.start("s1", {}, producer(3), **callbacks, tenant=KA)).wait()
    await manager.close()
    await store.close()
    store = SQLiteStore(tmp_path / "s.db")
    manager = SessionManager(store)
    with pytest.raises(NotFound):
        await manager.listen("s1", -1, KB)
    assert len(await drain(manager.listen("s1", -1, KA))) == 4
    await manager.close()
    await store.close()


async def test_a_listener_ahead_of_the_producer_waits_for_the_events_after_it(
    any_store, producer, callbacks, drain
) -> None:
    manager = SessionManager(any_store)
    session = await manager.start("s1", {}, producer(40, delay=0.005), **callbacks)
    ahead = await asyncio.wait_for(drain(manager.listen("s1", 30)), 10)
    assert [e.index for e in ahead] == list(range(31, 41)) and ahead[-1].terminal
    assert [json.loads(e.data)["i"] for e in ahead[:-1]] == list(range(31, 40))
    await session.wait()
    assert await drain(manager.listen("s1", 500)) == []  # past the end of an ended one
    await manager.close()
