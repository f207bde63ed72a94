"""The load tester: N streaming chat requests, at most C in flight, optionally Poisson-paced.

Like ``vllm bench serve``: arrivals follow a Poisson process of ``rate`` req/s (all at once when
``rate`` is None), a semaphore caps the requests in flight, and each request's clock starts when
it is actually sent (a request waiting for a slot is not charged for the wait). Every request
streams with ``stream_options.include_usage`` so token counts are the server's own. Metric
definitions live in :mod:`vlmserve.client.stats`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from rich.table import Table

from vlmserve.client.http import ServerUnreachable, describe_failure, error_text, open_client
from vlmserve.client.payload import build_bodies
from vlmserve.client.stats import LoadReport, RequestRecord, Summary, build_report
from vlmserve.client.stream import stream_chat

__all__ = ["LoadConfig", "LoadReport", "ServerUnreachable", "render_report", "run_load"]


@dataclass(slots=True)
class LoadConfig:
    base_url: str
    model: str
    concurrency: int = 8
    requests: int = 100
    rate: float | None = None  # req/s, Poisson arrivals; None: send as fast as slots free up
    image: tuple[int, int] | None = None  # (width, height) of a noise PNG in every request
    video_frames: int | None = None  # frames of a 64x64 noise MP4 in every request
    max_tokens: int = 64
    prompt_words: int = 32
    ignore_eos: bool = True
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    timeout: float = 300.0
    distinct_media: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag to fix."""
        positive = {
            "--concurrency": self.concurrency,
            "--requests": self.requests,
            "--max-tokens": self.max_tokens,
            "--prompt-words": self.prompt_words,
            "--timeout": self.timeout,
        }
        if self.video_frames is not None:
            positive["--video"] = self.video_frames
        if self.rate is not None:
            positive["--rate"] = self.rate
        if self.image is not None:
            positive["--image width"], positive["--image height"] = self.image
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        for flag, slo in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms)):
            if slo is not None and slo < 0:
                raise ValueError(f"{flag} must be >= 0, got {slo}")


async def run_load(
    cfg: LoadConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadReport:
    """Run the load; ``progress(done, total)`` after each answer. Raises ``ServerUnreachable``
    when the server can't be reached (or refuses the API key) before the first request."""
    cfg.check()
    bodies = build_bodies(
        model=cfg.model,
        requests=cfg.requests,
        max_tokens=cfg.max_tokens,
        prompt_words=cfg.prompt_words,
        ignore_eos=cfg.ignore_eos,
        seed=cfg.seed,
        image=cfg.image,
        video_frames=cfg.video_frames,
        distinct_media=cfg.distinct_media,
    )
    client = open_client(
        cfg.base_url,
        api_key=cfg.api_key,
        timeout=cfg.timeout,
        transport=transport,
        connections=cfg.concurrency,
    )
    async with client:
        await _reachable(client, cfg)
        records, duration = await _drive(client, cfg, bodies, progress)
    return build_report(
        records,
        duration,
        slo_ttft_ms=cfg.slo_ttft_ms,
        slo_tpot_ms=cfg.slo_tpot_ms,
        config=_echo(cfg),
    )


async def _reachable(client: httpx.AsyncClient, cfg: LoadConfig) -> None:
    try:
        response = await client.get("/v1/models", timeout=min(cfg.timeout, 30.0))
    except httpx.HTTPError as exc:
        raise ServerUnreachable(describe_failure(exc, str(client.base_url), 30.0)) from exc
    if response.status_code in (401, 403):
        raise ServerUnreachable(error_text(response.status_code, response.content))


async def _drive(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    bodies: list[dict[str, Any]],
    progress: Callable[[int, int], None] | None,
) -> tuple[list[RequestRecord], float]:
    total = len(bodies)
    slots = asyncio.Semaphore(cfg.concurrency)
    records: list[RequestRecord] = [RequestRecord() for _ in bodies]
    done = 0
    if progress:
        progress(0, total)

    async def one(i: int) -> None:
        nonlocal done
        async with slots:
            records[i] = await stream_chat(client, bodies[i])
        done += 1
        if progress:
            progress(done, total)

    arrivals = random.Random(cfg.seed)
    started = time.perf_counter()
    tasks = []
    for i in range(total):
        tasks.append(asyncio.create_task(one(i)))
        if cfg.rate is not None and i < total - 1:
            await asyncio.sleep(arrivals.expovariate(cfg.rate))  # Poisson: exponential gaps
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - started


def _echo(cfg: LoadConfig) -> dict[str, Any]:
    echo = asdict(cfg)
    echo["api_key"] = "***" if cfg.api_key else None
    return echo


def _ms(summary: Summary) -> list[str]:
    return [
        f"{summary.mean:.2f}",
        f"{summary.median:.2f}",
        f"{summary.p90:.2f}",
        f"{summary.p99:.2f}",
    ]


def render_report(report: LoadReport) -> Table:
    """The report as one table: scalars in the first value column, latencies as mean..p99."""
    table = Table(title="vlmserve loadtest", title_justify="left")
    table.add_column("metric", no_wrap=True)
    for name in ("value / mean", "median", "p90", "p99"):
        table.add_column(name, justify="right", no_wrap=True)
    errors = ", ".join(f"{k}: {v}" for k, v in report.errors.items()) or "-"
    rows = [
        ("requests completed", f"{report.completed}/{report.requests}"),
        ("failed", f"{report.failed} ({errors})"),
        ("duration (s)", f"{report.duration_s:.2f}"),
        ("request throughput (req/s)", f"{report.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{report.output_throughput:.2f}"),
        ("total token throughput (tok/s)", f"{report.total_token_throughput:.2f}"),
        ("total input tokens", str(report.total_input_tokens)),
        ("total output tokens", str(report.total_output_tokens)),
    ]
    if report.goodput is not None:
        rows.append(("goodput (req/s within SLOs)", f"{report.goodput:.2f}"))
    for label, value in rows:
        table.add_row(label, value)
    table.add_section()
    latencies = {
        "TTFT (ms)": report.ttft_ms,
        "TPOT (ms)": report.tpot_ms,
        "ITL (ms)": report.itl_ms,
        "E2E latency (ms)": report.e2e_ms,
    }
    for label, summary in latencies.items():
        table.add_row(label, *_ms(summary))
    return table
