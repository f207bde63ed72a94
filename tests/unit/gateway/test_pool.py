"""ReplicaPool: least outstanding choice, passive ejection and cool-down, 503, 429."""

from __future__ import annotations

import asyncio

import pytest

from vlmserve.errors import Overloaded, ServiceUnavailable
from vlmserve.gateway.pool import PoolPolicy, ReplicaPool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(*urls: str, clock: Clock | None = None, **policy: float) -> ReplicaPool:
    return ReplicaPool("m", list(urls), PoolPolicy(**policy), clock=clock or Clock())  # type: ignore[arg-type]


async def test_picks_the_replica_with_fewest_outstanding_requests() -> None:
    p = pool("http://a", "http://b")
    first = await p.take()
    second = await p.take()
    assert {first.url, second.url} == {"http://a", "http://b"}
    p.give(first)
    third = await p.take()
    assert third is first  # the other still has one in flight
    assert (first.outstanding, second.outstanding) == (1, 1)


async def test_base_urls_are_normalised_without_v1_suffix() -> None:
    p = pool("http://a:1/v1/", "http://b:2/")
    assert [r.url for r in p.replicas] == ["http://a:1", "http://b:2"]


async def test_consecutive_failures_eject_then_cool_down_restores() -> None:
    clock = Clock()
    p = pool("http://a", "http://b", clock=clock, max_failures=2, eject_seconds=30)
    a = p.replicas[0]
    p.failed(a, "connection refused")
    assert p.choose(exclude={"http://b"}) is a  # one failure is not enough
    p.failed(a, "connection refused")
    assert p.choose(exclude={"http://b"}) is None
    assert [(await p.take()).url for _ in range(3)] == ["http://b"] * 3
    clock.now += 29
    assert p.choose(exclude={"http://b"}) is None
    clock.now += 2
    assert p.choose(exclude={"http://b"}) is a


async def test_success_resets_the_failure_count() -> None:
    p = pool("http://a", max_failures=2)
    a = p.replicas[0]
    p.failed(a, "reset")
    p.succeeded(a)
    p.failed(a, "reset")
    assert p.choose() is a


async def test_no_usable_replica_is_503_with_retry_after_of_the_earliest_return() -> None:
    clock = Clock()
    p = pool("http://a", "http://b", clock=clock, max_failures=1, eject_seconds=12)
    p.failed(p.replicas[0], "refused")
    p.checked(p.replicas[1], False, "GET /health answered 500")
    with pytest.raises(ServiceUnavailable) as info:
        await p.take()
    assert info.value.status_code == 503
    assert 1 <= info.value.retry_after <= 5
    assert "GET /health answered 500" in info.value.message
    assert "ejected" in info.value.message


async def test_empty_pool_says_how_to_add_replicas() -> None:
    with pytest.raises(ServiceUnavailable, match="register"):
        await pool().take()


async def test_admission_beyond_max_queued_is_429() -> None:
    p = pool("http://a", max_queued=2)
    p.admit()
    p.admit()
    with pytest.raises(Overloaded) as info:
        p.admit()
    assert info.value.status_code == 429
    p.leave()
    p.admit()  # room again


async def test_failed_preflight_keeps_replica_out_until_registered_again() -> None:
    p = pool("http://a")
    a = p.replicas[0]
    p.preflight(a, False, "chat_stream: no [DONE]")
    p.checked(a, True)  # a passing health check does not bring it back
    assert p.choose() is None
    assert p.describe()[0]["reason"] == "preflight failed: chat_stream: no [DONE]"
    assert p.add("http://a", "w1") is a
    assert p.choose() is a


async def test_per_replica_cap_makes_requests_wait_for_a_slot() -> None:
    p = pool("http://a", max_concurrency=1)
    held = await p.take()
    waiter = asyncio.create_task(p.take())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    p.give(held)
    assert await asyncio.wait_for(waiter, 2) is held


async def test_remove_by_instance() -> None:
    p = pool()
    p.add("http://a", "w1")
    p.add("http://b", "w2")
    assert p.remove(instance="w1")
    assert [r.url for r in p.replicas] == ["http://b"]
    assert not p.remove(instance="w1")
