"""The media memory budget: FIFO admission, a bounded queue, 429 and 413, leases."""

from __future__ import annotations

import asyncio

import pytest

from vlmserve.errors import Overloaded, PayloadTooLarge
from vlmserve.media.workers import MediaBudget, current_lease, hand_over


async def test_a_request_that_fits_is_admitted_at_once_and_its_release_frees_the_bytes() -> None:
    budget = MediaBudget(100)
    lease = await budget.admit(60)
    assert budget.used == 60
    lease.grow(30)  # decoded pixels of an admitted request: charged, never waited for
    assert budget.used == 90
    lease.release()
    lease.release()  # idempotent
    assert budget.used == 0


async def test_one_body_larger_than_the_whole_budget_is_a_413_naming_the_setting() -> None:
    with pytest.raises(PayloadTooLarge, match="VLMSERVE_MEDIA_MEMORY"):
        await MediaBudget(100).admit(101)


async def test_waiters_are_admitted_in_order_as_room_is_released() -> None:
    budget = MediaBudget(100, queue_max=4, max_wait=5)
    first = await budget.admit(80)
    order: list[int] = []

    async def wait(n: int, tag: int) -> None:
        lease = await budget.admit(n)
        order.append(tag)
        await asyncio.sleep(0.01)
        lease.release()

    tasks = [asyncio.create_task(wait(50, 1)), asyncio.create_task(wait(10, 2))]
    await asyncio.sleep(0.01)
    assert budget.waiting == 2 and order == []  # 10 would fit, but FIFO keeps it behind 50
    first.release()
    await asyncio.gather(*tasks)
    assert order == [1, 2] and budget.used == 0


async def test_a_full_queue_is_a_429_with_retry_after() -> None:
    budget = MediaBudget(100, queue_max=1, max_wait=5)
    held = await budget.admit(100)
    waiter = asyncio.create_task(budget.admit(10))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="VLMSERVE_MEDIA_MEMORY") as caught:
        await budget.admit(10)
    assert caught.value.retry_after >= 1
    held.release()
    (await waiter).release()
    assert budget.used == 0


async def test_a_wait_that_runs_out_is_a_429_and_leaves_nothing_behind() -> None:
    budget = MediaBudget(100, queue_max=4, max_wait=0.05)
    held = await budget.admit(90)
    with pytest.raises(Overloaded):
        await budget.admit(20)
    assert budget.waiting == 0
    held.release()
    assert budget.used == 0
    (await budget.admit(100)).release()


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    budget = MediaBudget(100, queue_max=4, max_wait=5)
    held = await budget.admit(100)
    waiter = asyncio.create_task(budget.admit(50))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held.release()
    assert budget.waiting == 0 and budget.used == 0


async def test_hand_over_frees_the_decoded_media_and_the_end_frees_the_body() -> None:
    budget = MediaBudget(100)
    lease = await budget.admit(40)
    token = budget.use(lease)
    try:
        assert current_lease() is lease
        lease.grow(25)
        hand_over()  # the pixels are the engine's; the parsed body lives until the end
        assert budget.used == 40 and not lease.released
        lease.release()
        assert budget.used == 0
    finally:
        token.var.reset(token)
    assert current_lease() is None
