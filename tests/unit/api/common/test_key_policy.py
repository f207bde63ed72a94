"""KeyPolicy: the prefix-cache salt of a key's requests and its cap on generations at once."""

from __future__ import annotations

import pytest

from vlmserve.api.auth import ANONYMOUS, owner_of
from vlmserve.api.common.keys import KeyedLease, KeyPolicy
from vlmserve.config import Settings
from vlmserve.errors import Overloaded

A, B = owner_of(b"k1"), owner_of(b"k2")


def test_with_keys_each_key_salts_its_own_blocks_and_keeps_a_requests_own_salt() -> None:
    keyed = KeyPolicy(keyed=True)
    assert keyed.salt(A, None) == A and keyed.salt(B, None) == B
    assert keyed.salt(A, "mine") == f"{A}:mine" != keyed.salt(B, "mine")


@pytest.mark.parametrize(
    "policy,owner",
    [
        (KeyPolicy(keyed=False), ANONYMOUS),  # no keys: nothing salted
        (KeyPolicy(keyed=True, prefix_scope="global"), A),  # shared between keys
        (KeyPolicy(keyed=True), ANONYMOUS),
    ],
)
def test_unsalted_unless_keys_and_key_scope(policy: KeyPolicy, owner: str) -> None:
    assert policy.salt(owner, None) is None and policy.salt(owner, "s") == "s"


def test_a_key_holds_at_most_its_cap_and_each_release_frees_one_place_once() -> None:
    policy = KeyPolicy(keyed=True, max_concurrent=2)
    first, second = policy.take(A), policy.take(A)
    with pytest.raises(Overloaded) as caught:
        policy.take(A)
    assert caught.value.status_code == 429 and caught.value.retry_after == 1.0
    assert caught.value.code == "key_concurrency_limit"
    assert "VLMSERVE_MAX_CONCURRENT_PER_KEY=2" in caught.value.message
    policy.take(B)()  # another key's places are its own
    first()
    first()  # twice: still one place
    third = policy.take(A)
    with pytest.raises(Overloaded):
        policy.take(A)
    second()
    third()
    assert policy.running.get(A) is None  # nothing left behind for a key that stopped


@pytest.mark.parametrize("policy", [KeyPolicy(keyed=True), KeyPolicy(max_concurrent=1)])
def test_no_cap_without_keys_or_with_a_zero_cap(policy: KeyPolicy) -> None:
    for _ in range(5):
        policy.take(A)
    assert policy.running == {}


def test_a_keyed_lease_releases_the_model_lease_and_the_place_together() -> None:
    released: list[str] = []

    class Lease:
        backend = "the backend"

        def release(self) -> None:
            released.append("lease")
            raise RuntimeError("the lease's own failure")

    lease = KeyedLease(Lease(), lambda: released.append("place"))
    assert lease.backend == "the backend"
    with pytest.raises(RuntimeError):
        lease.release()
    assert released == ["lease", "place"]  # the place is freed even when the lease fails


def test_a_cap_of_one_holds_one_generation() -> None:
    policy = KeyPolicy(keyed=True, max_concurrent=1)
    release = policy.take(A)
    with pytest.raises(Overloaded):
        policy.take(A)
    release()
    policy.take(A)


def test_the_policy_comes_from_the_settings() -> None:
    settings = Settings(api_keys=["k1"], prefix_cache_scope="global", max_concurrent_per_key=3)
    assert KeyPolicy.from_settings(settings) == KeyPolicy(True, "global", 3)
    assert KeyPolicy.from_settings(Settings()) == KeyPolicy(False, "key", 0)
