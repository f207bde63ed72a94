"""Load-test statistics, defined as ``vllm bench serve`` (``benchmarks/benchmark_serving.py``) does.

Per successful request (times in seconds, measured on the client):

    ttft      send -> first chunk that carries a generated token (not the role-only opener)
    itl       the gaps between consecutive token chunks (one entry per gap, all requests pooled)
    e2e       send -> end of the stream
    tpot      (e2e - ttft) / (output_tokens - 1), only where output_tokens > 1; for goodput a
              request with <= 1 output token has tpot 0, as in vLLM
    tokens    prompt and completion tokens from the server's ``usage`` chunk

Over the run (``duration`` = first send -> last answer):

    request_throughput      completed / duration
    output_throughput       sum(output tokens) / duration
    total_token_throughput  sum(input + output tokens) / duration
    goodput                 completed requests meeting EVERY given SLO / duration; None if no SLO

Percentiles interpolate linearly between closest ranks (numpy's default). An empty series
summarises to zeros, as vLLM reports it (``completed`` says whether there was anything to time).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LoadReport", "RequestRecord", "Summary", "build_report", "percentile", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. ``error`` is None on success, else its count key:
    the HTTP status (``"503"``), ``"connection"``, ``"timeout"`` or ``"stream_error"``."""

    error: str | None = None
    message: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_seen: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Summary:
    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks like ``numpy.percentile``."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> Summary:
    """Mean, median, p90 and p99 of ``values``, each multiplied by ``scale`` (1000: s -> ms)."""
    if not values:
        return Summary()
    mean = math.fsum(values) / len(values)
    return Summary(
        mean * scale,
        percentile(values, 50) * scale,
        percentile(values, 90) * scale,
        percentile(values, 99) * scale,
    )


@dataclass(slots=True)
class LoadReport:
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    goodput: float | None
    config: dict[str, Any] = field(default_factory=dict)  # what was run, for the JSON file
    error_examples: dict[str, str] = field(default_factory=dict)  # one message per error key
    usage_missing: int = 0  # successes whose stream had no usage chunk (token totals undercount)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            out[key] = getattr(self, key).to_dict()
        return out


def meets_slos(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within every SLO given (tpot of a <=1-token answer counts as 0)."""
    if not record.ok:
        return False
    if slo_ttft_ms is not None and record.ttft * 1000 > slo_ttft_ms:
        return False
    return not (slo_tpot_ms is not None and (record.tpot or 0.0) * 1000 > slo_tpot_ms)


def build_report(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    config: dict[str, Any] | None = None,
) -> LoadReport:
    done = [r for r in records if r.ok]
    failures = [r for r in records if not r.ok]
    errors = Counter(str(r.error) for r in failures)
    examples: dict[str, str] = {}
    for r in failures:
        examples.setdefault(str(r.error), r.message)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    good: float | None = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = per_s(sum(meets_slos(r, slo_ttft_ms, slo_tpot_ms) for r in done))
    tpots = [t for r in done if (t := r.tpot) is not None]
    return LoadReport(
        requests=len(records),
        completed=len(done),
        failed=len(failures),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(outputs),
        total_token_throughput=per_s(inputs + outputs),
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        ttft_ms=summarize([r.ttft for r in done], 1000),
        tpot_ms=summarize(tpots, 1000),
        itl_ms=summarize([gap for r in done for gap in r.itl], 1000),
        e2e_ms=summarize([r.e2e for r in done], 1000),
        goodput=good,
        config=dict(config or {}),
        error_examples=examples,
        usage_missing=sum(not r.usage_seen for r in done),
    )
