"""What the side-by-side benchmarks share once their rounds are measured: the order that
rotates with the round, medians over rounds, ratios and how a missing figure prints.

Each sample is keyed by who was measured (a server or a client) and the concurrency level;
its figures are a flat dict of numbers (``vllm_client.read_result``'s names)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["config_json", "fmt", "medians", "ratio", "rotated"]


def rotated(names: Sequence[str], rnd: int) -> list[str]:
    """All of ``names``, the first one rotating with the round."""
    k = rnd % len(names)
    return [*names[k:], *names[:k]]


def medians(
    samples: Iterable[tuple[tuple[str, int], dict[str, Any]]], metrics: Sequence[str]
) -> dict[tuple[str, int], dict[str, float]]:
    """Per (name, level): the median over rounds of each of ``metrics``, the rounds and the
    failed requests of all of them."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for key, figures in samples:
        groups.setdefault(key, []).append(figures)
    return {
        key: {
            **{m: float(statistics.median(f[m] for f in figs)) for m in metrics},
            "rounds": len(figs),
            "failed": sum(int(f["failed"]) for f in figs),
        }
        for key, figs in groups.items()
    }


def ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 or either is NaN."""
    return a / b if b and a == a and b == b else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted, ``-`` when it is missing or NaN."""
    return "-" if value is None or value != value else format(value, spec)


def config_json(cfg: Any) -> dict[str, Any]:
    """A config dataclass as JSON-ready values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
