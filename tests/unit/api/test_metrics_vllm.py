"""vLLM's label values and buckets, and the per-request timings object (pure functions)."""

from __future__ import annotations

import pytest

from vlmserve.api.common.timings import RequestClock, metrics_object, server_timing
from vlmserve.api.metrics_vllm import finished_reason, token_buckets


def test_finish_reasons_map_to_vllms_labels() -> None:
    ours = ("stop", "tool_calls", "length", "cancelled", "repetition", "error")
    assert [finished_reason(r) for r in ours] == [
        "stop",
        "stop",
        "length",
        "abort",
        "repetition",
        "error",
    ]


def test_token_buckets_are_vllms_1_2_5_series() -> None:
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000


def test_the_metrics_object_has_vllms_fields_and_ours() -> None:
    timings = {"media": 0.01, "queue": 0.02, "vision": 0.03, "prefill": 0.04, "decode": 0.9}
    out = metrics_object({**timings, "e2e": 1.0}, completion_tokens=10)
    assert out["time_to_first_token_ms"] == pytest.approx(70.0)
    assert out["generation_time_ms"] == pytest.approx(900.0)
    assert out["queue_time_ms"] == pytest.approx(20.0)
    assert out["mean_itl_ms"] == pytest.approx(100.0)
    assert out["tokens_per_second"] == pytest.approx(10 / 0.97, abs=0.001)
    assert (out["media_ms"], out["vision_ms"], out["prefill_ms"], out["e2e_ms"]) == (
        10.0,
        30.0,
        40.0,
        1000.0,
    )
    assert metrics_object({**timings, "e2e": 1.0}, completion_tokens=1)["mean_itl_ms"] is None


def test_without_engine_phases_the_clock_splits_at_the_first_token() -> None:
    clock = RequestClock(opened=10.0, prepared=10.5, first=11.0, last=13.0)
    phases = clock.phases(None, now=13.5)
    assert phases == {
        "media": 0.5,
        "queue": 0.0,
        "vision": 0.0,
        "prefill": 0.5,
        "decode": 2.0,
        "e2e": 3.5,
    }
    assert server_timing(phases).startswith("media;dur=500.0, queue;dur=0.0, vision;dur=0.0")


def test_engine_phases_that_began_before_the_prepare_was_answered_shorten_media() -> None:
    clock = RequestClock(opened=10.0, prepared=10.5)
    engine = {"queue": 0.2, "vision": 0.1, "prefill": 0.4, "decode": 2.0}
    started_early = clock.phases(engine, now=13.0)  # the engine's 2.7 s began at 10.3
    assert started_early["media"] == pytest.approx(0.3)
    assert sum(v for k, v in started_early.items() if k != "e2e") == pytest.approx(3.0)
    assert clock.phases(engine, now=13.5)["media"] == pytest.approx(0.5)  # hops after it
