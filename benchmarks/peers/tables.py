"""Summaries of load reports across rounds, ratios between servers, and the rich tables.

Inputs are ``LoadReport.to_dict()`` dicts, so this module needs neither the servers nor the load
tester and is tested on canned reports.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from peers.rounds import fmt, ratio

__all__ = ["Row", "ratio_rows", "render", "summarize"]


@dataclass(slots=True)
class Row:
    """One server at one concurrency of one workload: medians over rounds (throughput range
    kept too). ITL: each round's percentile of its pooled inter-token gaps, median of rounds."""

    server: str
    concurrency: int
    rounds: int
    requests: int
    failed: int
    output_tps: float
    output_tps_min: float
    output_tps_max: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float
    usage_missing: int = 0  # replies without a usage chunk: tokens counted from stream chunks
    workload: str = "short"
    itl_p50_ms: float = float("nan")
    itl_p99_ms: float = float("nan")
    input_tokens: float = float("nan")  # prompt tokens per completed request (usage), median


Sample = tuple[str, int, dict[str, Any]] | tuple[str, int, dict[str, Any], str]


def summarize(samples: Iterable[Sample]) -> list[Row]:
    """Group ``(server, concurrency, report[, workload])`` by workload, server and
    concurrency, in first-seen order; the workload defaults to ``short``."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for server, concurrency, report, *workload in samples:
        key = (workload[0] if workload else "short", server, concurrency)
        groups.setdefault(key, []).append(report)
    rows = []
    for (workload, server, concurrency), reports in groups.items():
        tps = [float(r["output_throughput"]) for r in reports]
        rows.append(
            Row(
                server=server,
                concurrency=concurrency,
                rounds=len(reports),
                requests=sum(int(r["requests"]) for r in reports),
                failed=sum(int(r["failed"]) for r in reports),
                output_tps=statistics.median(tps),
                output_tps_min=min(tps),
                output_tps_max=max(tps),
                ttft_p50_ms=_median_of(reports, "ttft_ms"),
                tpot_p50_ms=_median_of(reports, "tpot_ms"),
                e2e_p50_ms=_median_of(reports, "e2e_ms"),
                usage_missing=sum(int(r.get("usage_missing", 0)) for r in reports),
                workload=workload,
                itl_p50_ms=_median_of(reports, "itl_ms"),
                itl_p99_ms=_median_of(reports, "itl_ms", "p99"),
                input_tokens=_input_tokens(reports),
            )
        )
    order = {w: i for i, w in enumerate(dict.fromkeys(r.workload for r in rows))}
    rows.sort(key=lambda r: (order[r.workload], r.concurrency))  # stable: server order kept
    return rows


def _input_tokens(reports: list[dict[str, Any]]) -> float:
    per = [r["total_input_tokens"] / r["completed"] for r in reports if r.get("completed")]
    return float(statistics.median(per)) if per else float("nan")


def _median_of(reports: list[dict[str, Any]], metric: str, stat: str = "median") -> float:
    values = [r[metric][stat] for r in reports if r.get(metric, {}).get(stat) is not None]
    return float(statistics.median(values)) if values else float("nan")


def ratio_rows(rows: list[Row], base: str, others: list[str]) -> list[dict[str, Any]]:
    """``base``/other per workload and level: output tok/s (>1: base faster); TTFT, TPOT and
    ITL p50/p99 (<1: base quicker)."""
    by_key = {(r.workload, r.server, r.concurrency): r for r in rows}
    out = []
    for workload, concurrency in dict.fromkeys((r.workload, r.concurrency) for r in rows):
        mine = by_key.get((workload, base, concurrency))
        for other in others:
            theirs = by_key.get((workload, other, concurrency))
            if mine is None or theirs is None:
                continue
            out.append(
                {
                    "workload": workload,
                    "concurrency": concurrency,
                    "base": base,
                    "other": other,
                    "output_tps_ratio": ratio(mine.output_tps, theirs.output_tps),
                    "ttft_p50_ratio": ratio(mine.ttft_p50_ms, theirs.ttft_p50_ms),
                    "tpot_p50_ratio": ratio(mine.tpot_p50_ms, theirs.tpot_p50_ms),
                    "itl_p50_ratio": ratio(mine.itl_p50_ms, theirs.itl_p50_ms),
                    "itl_p99_ratio": ratio(mine.itl_p99_ms, theirs.itl_p99_ms),
                }
            )
    return out


def results_table(rows: list[Row]) -> Table:
    table = Table(title="Output tokens/s and latency (medians over rounds)")
    table.add_column("workload", no_wrap=True)
    table.add_column("conc", justify="right")
    table.add_column("server", no_wrap=True)
    for name in ("in tok/req", "out tok/s", "range", "TTFT p50 ms", "TPOT p50 ms"):
        table.add_column(name, justify="right")
    for name in ("ITL p50 ms", "ITL p99 ms", "e2e p50 ms", "failed"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            r.workload,
            str(r.concurrency),
            r.server,
            fmt(r.input_tokens, ",.0f"),
            fmt(r.output_tps, ",.1f"),
            f"{fmt(r.output_tps_min, ',.0f')}-{fmt(r.output_tps_max, ',.0f')}",
            fmt(r.ttft_p50_ms, ",.1f"),
            fmt(r.tpot_p50_ms, ",.2f"),
            fmt(r.itl_p50_ms, ",.2f"),
            fmt(r.itl_p99_ms, ",.1f"),
            fmt(r.e2e_p50_ms, ",.0f"),
            f"{r.failed}/{r.requests}" if r.failed else "0",
        )
    return table


def ratios_table(ratios: list[dict[str, Any]], sequential: str) -> Table:
    table = Table(title="Ratios (tok/s >1 and latencies <1 favour the first server)")
    table.add_column("workload", no_wrap=True)
    table.add_column("conc", justify="right")
    table.add_column("comparison")
    for name in ("out tok/s", "TTFT p50", "TPOT p50", "ITL p50", "ITL p99"):
        table.add_column(name, justify="right")
    for r in ratios:
        label = f"{r['base']} / {r['other']}"
        if r["other"] == sequential:
            label += " (batched vs one-at-a-time)"
        keys = ("output_tps", "ttft_p50", "tpot_p50", "itl_p50", "itl_p99")
        cells = [fmt(r.get(f"{k}_ratio"), ".2f") for k in keys]
        table.add_row(r.get("workload", "short"), str(r["concurrency"]), label, *cells)
    return table


def render(
    console: Console,
    rows: list[Row],
    ratios: list[dict[str, Any]],
    status: dict[str, str],
    sequential: str,
) -> None:
    console.print(results_table(rows))
    if ratios:
        console.print(ratios_table(ratios, sequential))
    for server in dict.fromkeys(r.server for r in rows if r.usage_missing):
        console.print(
            f"[yellow]{server}: replies without a usage chunk; its output tokens are counted "
            "from stream chunks and may undercount"
        )
    for server, state in status.items():
        if state != "ok":
            console.print(f"[red]{server}: not measured: {state}")
