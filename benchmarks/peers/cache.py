"""The media-cache check of benchmarks/serve.py: TTFT of a repeated image against a new one.

One vlmserve server (``--max-pixels`` at Qwen2-VL's documented 1280*28*28, so a 448x448
image is 1,024 patches as on the real model), one request at a time, a few output tokens.
*Cold* requests each carry an image the server has never seen (a fresh seed per round), so
every one is decoded, preprocessed and run through the vision tower. *Warm* requests all carry
the same image, sent once before the measurement, so the processor cache and the vision cache
(``/metrics``: ``processor_cache_hits``, ``vision_cache_hits``) answer for it.
Cold and warm alternate for ``rounds`` rounds; the ratio is of the medians.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

__all__ = ["CacheCheck", "cache_table", "run_cache_check"]

_TARGET = 0.5  # the bar: warm TTFT at most half of cold


@dataclass(slots=True)
class CacheCheck:
    image: tuple[int, int]
    requests: int  # per measurement
    cold_ttft_ms: list[float] = field(default_factory=list)  # median TTFT of each cold round
    warm_ttft_ms: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if not self.cold_ttft_ms or not self.warm_ttft_ms:
            return None
        return statistics.median(self.warm_ttft_ms) / statistics.median(self.cold_ttft_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": list(self.image),
            "requests": self.requests,
            "cold_ttft_ms": self.cold_ttft_ms,
            "warm_ttft_ms": self.warm_ttft_ms,
            "warm_over_cold": self.ratio,
        }


def _load(base_url: str, model: str, image: tuple[int, int], requests: int, **kw: Any) -> Any:
    from vlmserve.client.loadtest import LoadConfig

    return LoadConfig(
        base_url=base_url,
        model=model,
        concurrency=1,
        requests=requests,
        image=image,
        max_tokens=4,
        prompt_words=16,
        **kw,
    )


def _median_ttft(cfg: Any) -> float:
    from vlmserve.client.loadtest import run_load

    report = asyncio.run(run_load(cfg)).to_dict()
    if report["failed"]:
        failed, total = report["failed"], report["requests"]
        raise RuntimeError(f"{failed} of {total} media-cache check requests failed")
    return float(report["ttft_ms"]["median"])


def run_cache_check(
    base_url: str,
    model: str,
    image: tuple[int, int],
    *,
    rounds: int,
    requests: int,
    log: Callable[[str], None] = print,
) -> CacheCheck:
    check = CacheCheck(image=image, requests=requests)
    warm_seed = 7
    _median_ttft(_load(base_url, model, image, 1, seed=warm_seed))  # the warm image, seen once
    for rnd in range(rounds):
        cold = _load(base_url, model, image, requests, seed=10_000 * (rnd + 1), distinct_media=True)
        check.cold_ttft_ms.append(_median_ttft(cold))
        warm = _load(base_url, model, image, requests, seed=warm_seed)
        check.warm_ttft_ms.append(_median_ttft(warm))
        log(
            f"cache round {rnd + 1}/{rounds}: TTFT p50 new image {check.cold_ttft_ms[-1]:.1f} ms, "
            f"repeated image {check.warm_ttft_ms[-1]:.1f} ms"
        )
    return check


def cache_table(check: CacheCheck) -> Table:
    w, h = check.image
    table = Table(title=f"Media caches: TTFT of a repeated {w}x{h} image vs a new one (conc 1)")
    for name in ("new image TTFT p50 ms", "repeated image TTFT p50 ms", "repeated / new", "target"):
        table.add_column(name, justify="right")
    ratio = check.ratio
    table.add_row(
        f"{statistics.median(check.cold_ttft_ms):.1f}" if check.cold_ttft_ms else "-",
        f"{statistics.median(check.warm_ttft_ms):.1f}" if check.warm_ttft_ms else "-",
        f"{ratio:.2f}" if ratio is not None else "-",
        f"<= {_TARGET}",
    )
    return table
