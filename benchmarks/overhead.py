"""What durable streams and the gateway cost: side by side, one run, ratios.

    python benchmarks/overhead.py                        # c=1 and c=8, 2 interleaved rounds
    python benchmarks/overhead.py --rounds 3 --json overhead.json

Three servers on the same tiny checkpoint, driven by the same client (streamed image requests
of a fixed length, ``vlmserve.client.loadtest``):

- ``memory``: a vlmserve worker with the default in-memory stream store (the baseline);
- ``sqlite``: the same with ``VLMSERVE_PERSIST_SESSIONS=1`` (every event committed to SQLite
  before a client sees it);
- ``gateway``: a vlmserve gateway whose registry has one ``openai`` entry pointing at the
  ``memory`` worker (requests go client -> gateway -> worker).

Rounds are interleaved (each round visits every concurrency and, within it, every server in
an order that rotates), so drift of the machine hits all alike. Budgets (issue 22): SQLite
costs <= 10% output tok/s and <= 10% TTFT p50 at c=8; the gateway adds <= 1 ms TTFT p50 at
c=1. The gateway and the worker share this machine's cores, which a real deployment does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import SERVED_NAME, ServerSpec, free_ports, vlmserve_spec
from peers.tables import Row, summarize
from serve import BenchConfig, build_config, run_rounds
from serve import parse_args as serve_args

__all__ = ["budgets", "main", "overhead_specs"]

BASE, SQLITE, GATEWAY = "memory", "sqlite", "gateway"
BUDGETS = {  # (setup, concurrency, metric): the most it may cost against the baseline
    (SQLITE, 8, "tok/s"): 0.10,
    (SQLITE, 8, "ttft"): 0.10,
    (GATEWAY, 1, "ttft_ms"): 1.0,
}


def _renamed(spec: ServerSpec, name: str, **env: str) -> ServerSpec:
    spec.name = name
    spec.env.update(env)
    return spec


def gateway_registry(path: Path, worker_url: str) -> Path:
    path.write_text(
        "[[models]]\n"
        f'name = "{SERVED_NAME}"\nbackend = "openai"\nroles = ["chat"]\n'
        "[models.backend_config]\n"
        f'base_urls = ["{worker_url}"]\n'
    )
    return path


def overhead_specs(cfg: BenchConfig, ports: list[int], work: Path) -> list[ServerSpec]:
    memory = _renamed(vlmserve_spec(cfg.model_dir, ports[0], cfg.dtype), BASE)
    sqlite = _renamed(vlmserve_spec(cfg.model_dir, ports[1], cfg.dtype), SQLITE,
                      VLMSERVE_PERSIST_SESSIONS="1",
                      VLMSERVE_SESSIONS_DB_PATH=str(work / "sessions.db"))  # fmt: skip
    registry = gateway_registry(work / "registry.toml", memory.url)
    gateway = vlmserve_spec(cfg.model_dir, ports[2], cfg.dtype)
    model_at = gateway.argv.index("--model")
    del gateway.argv[model_at : model_at + 4]  # no local model: --model DIR --served-model-name
    gateway.argv += ["--registry", str(registry)]
    return [memory, sqlite, _renamed(gateway, GATEWAY)]


def budgets(rows: list[Row]) -> list[dict[str, Any]]:
    """Each budget: the measured cost against the baseline, and whether it holds."""
    by = {(r.server, r.concurrency): r for r in rows}
    out = []
    for (setup, conc, metric), limit in BUDGETS.items():
        base, other = by.get((BASE, conc)), by.get((setup, conc))
        if base is None or other is None:
            continue
        if metric == "tok/s":
            cost = 1 - other.output_tps / base.output_tps
        elif metric == "ttft":
            cost = other.ttft_p50_ms / base.ttft_p50_ms - 1
        else:
            cost = other.ttft_p50_ms - base.ttft_p50_ms
        out.append({"setup": setup, "concurrency": conc, "metric": metric, "cost": cost,
                    "limit": limit, "ok": cost <= limit})  # fmt: skip
    return out


def _table(rows: list[Row]) -> Table:
    table = Table(title="durable streams and gateway overhead (medians over rounds)")
    for col in ("setup", "conc", "out tok/s", "range", "TTFT p50 ms", "TPOT p50 ms", "failed"):
        table.add_column(col, justify="right" if col != "setup" else "left")
    for r in rows:
        table.add_row(r.server, str(r.concurrency), f"{r.output_tps:,.0f}",
                      f"{r.output_tps_min:,.0f}-{r.output_tps_max:,.0f}",
                      f"{r.ttft_p50_ms:.1f}", f"{r.tpot_p50_ms:.2f}", str(r.failed))  # fmt: skip
    return table


def _budget_table(checks: list[dict[str, Any]]) -> Table:
    table = Table(title="budgets (issue 22)")
    for col in ("setup", "conc", "metric", "cost", "limit", "holds"):
        table.add_column(col)
    for c in checks:
        pct = c["metric"] != "ttft_ms"
        fmt = (lambda v: f"{v:+.1%}") if pct else (lambda v: f"{v:+.2f} ms")
        table.add_row(c["setup"], str(c["concurrency"]), c["metric"], fmt(c["cost"]),
                      fmt(c["limit"]), "yes" if c["ok"] else "[red]no")  # fmt: skip
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the tiny random-weight Qwen2-VL)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    forwarded = ["--concurrency", *map(str, ns.concurrency), "--rounds", str(ns.rounds),
                 "--requests", str(ns.requests), "--max-tokens", str(ns.max_tokens),
                 "--no-sequential"]  # fmt: skip
    cfg = build_config(serve_args(forwarded + (["--model", ns.model] if ns.model else [])))
    console = Console(width=None if sys.stdout.isatty() else 132)
    if not cfg.model_dir:
        from vlmserve.testing import build_qwen2_vl

        cfg.model_dir = str(build_qwen2_vl())
    with tempfile.TemporaryDirectory(prefix="vlmserve-overhead-") as work:
        specs = overhead_specs(cfg, free_ports(3), Path(work))
        out = run_rounds(specs, cfg, console)
    rows = summarize([(s.server, s.concurrency, s.report) for s in out.samples])
    checks = budgets(rows)
    console.print(_table(rows))
    console.print(_budget_table(checks))
    if ns.json_path:
        result = {"status": out.status, "samples": [asdict(s) for s in out.samples],
                  "summary": [asdict(r) for r in rows], "budgets": checks}  # fmt: skip
        Path(ns.json_path).write_text(json.dumps(result, indent=2))
        console.print(f"wrote {ns.json_path}")
    return 0 if all(state == "ok" for state in out.status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
