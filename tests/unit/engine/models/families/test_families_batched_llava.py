"""The batched-family contract (``test_families_batched.py``) on LLaVA-1.5 and LLaVA-OneVision."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.unit.engine.models.families.test_families_batched import (
    backend_for,
    test_batched_greedy_matches_transformers_generate,
    test_eight_concurrent_requests_decode_together,
    test_greedy_output_is_identical_alone_and_joining_a_busy_batch,
)

from vlmserve.engine.hf.chat import HFChatBackend

__all__ = [
    "test_batched_greedy_matches_transformers_generate",
    "test_eight_concurrent_requests_decode_together",
    "test_greedy_output_is_identical_alone_and_joining_a_busy_batch",
]


@pytest.fixture(scope="module", params=["llava", "llava_onevision"])
def family(request: pytest.FixtureRequest) -> Iterator[tuple[str, HFChatBackend]]:
    backend = backend_for(request.param)
    yield request.param, backend
    backend.close()
