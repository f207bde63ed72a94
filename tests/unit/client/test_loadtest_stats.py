"""The load tester's statistics on synthetic timings: vLLM's definitions, exactly."""

from __future__ import annotations

import random

import pytest

from vlmserve.client.stats import RequestRecord, build_report, percentile, summarize


def ok(ttft: float, e2e: float, out: int, itl: list[float] | None = None, prompt: int = 10):
    return RequestRecord(
        ttft=ttft, e2e=e2e, output_tokens=out, prompt_tokens=prompt, itl=itl or [], usage_seen=True
    )


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * (10 - 4))  # rank 3.6
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_percentile_agrees_with_numpy_default_method() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    values = [rng.expovariate(3.0) for _ in range(101)]
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_scales_seconds_to_milliseconds() -> None:
    s = summarize([0.1, 0.2, 0.3, 0.4], scale=1000)
    assert s.mean == pytest.approx(250.0) and s.median == pytest.approx(250.0)
    assert s.p90 == pytest.approx(370.0) and s.p99 == pytest.approx(397.0)
    assert summarize([]).to_dict() == {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert ok(0.5, 2.5, 5).tpot == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert ok(0.5, 0.5, 1).tpot is None and ok(0.5, 0.5, 0).tpot is None


def test_report_pools_itl_gaps_and_excludes_single_token_answers_from_tpot() -> None:
    records = [
        ok(0.1, 0.4, 4, itl=[0.1, 0.1, 0.1], prompt=20),
        ok(0.2, 0.2, 1, prompt=30),  # one token: no TPOT, no gaps
        ok(0.3, 1.3, 3, itl=[0.5, 0.5], prompt=40),
    ]
    report = build_report(records, duration_s=2.0)
    assert report.completed == 3 and report.failed == 0 and report.errors == {}
    assert report.total_input_tokens == 90 and report.total_output_tokens == 8
    assert report.request_throughput == pytest.approx(1.5)
    assert report.output_throughput == pytest.approx(4.0)
    assert report.total_token_throughput == pytest.approx(49.0)
    assert report.tpot_ms.mean == pytest.approx((100 + 500) / 2)  # only the 2 multi-token ones
    assert report.itl_ms.mean == pytest.approx((0.3 + 1.0) / 5 * 1000)
    assert report.itl_ms.median == pytest.approx(100.0)
    assert report.ttft_ms.median == pytest.approx(200.0)
    assert report.e2e_ms.mean == pytest.approx((0.4 + 0.2 + 1.3) / 3 * 1000)
    assert report.goodput is None  # no SLO given


def test_errors_are_counted_by_key_and_left_out_of_latency_and_tokens() -> None:
    records = [
        ok(0.1, 0.5, 5),
        RequestRecord(error="503", message="HTTP 503: busy", e2e=0.01, output_tokens=9),
        RequestRecord(error="503", message="HTTP 503: again"),
        RequestRecord(error="connection", message="refused"),
        RequestRecord(error="timeout"),
    ]
    report = build_report(records, duration_s=1.0)
    assert report.requests == 5 and report.completed == 1 and report.failed == 4
    assert report.errors == {"503": 2, "connection": 1, "timeout": 1}
    assert report.error_examples["503"] == "HTTP 503: busy"
    assert report.total_output_tokens == 5 and report.e2e_ms.mean == pytest.approx(500.0)


def test_goodput_counts_requests_within_every_given_slo() -> None:
    records = [
        ok(0.05, 0.05 + 9 * 0.02, 10),  # ttft 50ms, tpot 20ms
        ok(0.20, 0.20 + 9 * 0.02, 10),  # ttft too slow
        ok(0.05, 0.05 + 9 * 0.08, 10),  # tpot too slow
        ok(0.05, 0.05, 1),  # single token: tpot counts as 0 (vLLM)
        RequestRecord(error="500"),  # failures are never good
    ]
    both = build_report(records, 2.0, slo_ttft_ms=100, slo_tpot_ms=50)
    assert both.goodput == pytest.approx(2 / 2.0)
    ttft_only = build_report(records, 2.0, slo_ttft_ms=100)
    assert ttft_only.goodput == pytest.approx(3 / 2.0)
    tpot_only = build_report(records, 2.0, slo_tpot_ms=50)
    assert tpot_only.goodput == pytest.approx(3 / 2.0)


def test_to_dict_has_the_documented_keys() -> None:
    report = build_report([ok(0.1, 0.3, 3, itl=[0.1, 0.1])], 1.0, slo_ttft_ms=1000)
    out = report.to_dict()
    for key in (
        "requests",
        "completed",
        "failed",
        "errors",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "goodput",
    ):
        assert key in out
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(out[key]) == {"mean", "median", "p90", "p99"}
    assert out["goodput"] == pytest.approx(1.0)


def test_a_zero_duration_gives_zero_rates_not_a_crash() -> None:
    report = build_report([], 0.0, slo_ttft_ms=1)
    assert report.request_throughput == 0.0 and report.goodput == 0.0
