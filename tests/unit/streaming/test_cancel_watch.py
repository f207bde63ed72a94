"""CancelWatch: cancels announced by a shared store end the local session; a broken
subscription is retried; close stops it, and a manager started again listens again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from vlmserve.streaming import cancels as cancels_module
from vlmserve.streaming.cancels import CancelWatch

pytestmark = pytest.mark.timeout(30)


class Session:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def begin_cancel(self) -> None:
        self.cancelled.set()


class Store:
    """A store that announces cancels: the first subscription fails, the next ones work."""

    def __init__(self, fail_first: bool = True) -> None:
        self.announced: asyncio.Queue[str] = asyncio.Queue()
        self.subscriptions = 0
        self.fail_first = fail_first

    async def cancels(self) -> AsyncIterator[str]:
        self.subscriptions += 1
        if self.fail_first and self.subscriptions == 1:
            raise ConnectionError("redis is restarting")
        while True:
            yield await self.announced.get()


async def test_an_announced_cancel_ends_the_session_held_here_after_a_failed_subscription(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cancels_module, "RETRY_SECONDS", 0.01)
    store, held = Store(), {"s1": Session()}
    watch = CancelWatch(store, held.get)
    watch.ensure()
    watch.ensure()  # listening already: no second listener
    await store.announced.put("elsewhere")  # not held here: nothing happens
    await store.announced.put("s1")
    await asyncio.wait_for(held["s1"].cancelled.wait(), 5)
    assert store.subscriptions == 2
    assert "listening for cancels failed; retrying" in caplog.text
    assert any(r.exc_info for r in caplog.records if r.levelno == logging.WARNING)
    await watch.close()


async def test_close_stops_listening_and_a_restarted_manager_listens_again() -> None:
    store, held = Store(fail_first=False), {"s1": Session()}
    watch = CancelWatch(store, held.get)
    watch.ensure()
    await asyncio.sleep(0.01)
    await watch.close()
    await store.announced.put("s1")
    await asyncio.sleep(0.05)
    assert not held["s1"].cancelled.is_set()  # closed: nobody listens
    watch.ensure()
    await asyncio.wait_for(held["s1"].cancelled.wait(), 5)  # listening again
    assert store.subscriptions == 2
    await watch.close()


async def test_a_store_that_cannot_announce_is_not_listened_to() -> None:
    watch = CancelWatch(object(), {}.get)
    watch.ensure()
    assert watch._task is None
    await watch.close()
