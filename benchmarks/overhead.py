"""What durable streams and the gateway cost: side by side, one run, ratios.

    python benchmarks/overhead.py                        # c=1 and c=8, 2 interleaved rounds
    python benchmarks/overhead.py --runs 3 --rounds 2 --json overhead.json
    python benchmarks/overhead.py --runs 3 --rounds 3 --concurrency 8 --requests 192 \
        --setups memory sqlite                           # the SQLite store's budget

Three servers on the same tiny checkpoint, driven by the same client (streamed image requests
of a fixed length, ``vlmserve.client.loadtest``):

- ``memory``: a vlmserve worker with the default in-memory stream store (the baseline);
- ``sqlite``: the same with ``VLMSERVE_PERSIST_SESSIONS=1`` (every event committed to SQLite
  before a client sees it);
- ``gateway``: a vlmserve gateway whose registry has one ``openai`` entry pointing at the
  ``memory`` worker (requests go client -> gateway -> worker); its streams pass through as
  bytes (``gateway/passthrough.py``), the worker's own sessions;
- ``gateway-sessions``: the same gateway with ``VLMSERVE_GATEWAY_PASSTHROUGH=false``: every
  stream a session of the gateway's own, chunks parsed and re-encoded (the path before the
  pass-through, and still the path to upstreams that are not vlmserve workers);
- ``byteproxy``: the least a Python proxy does (``peers/byteproxy.py``: uvicorn + aiohttp,
  bytes forwarded untouched) in front of the same worker: the floor under the gateway's cost.

Rounds are interleaved (each round visits every concurrency and, within it, every server in
an order that rotates), so drift of the machine hits all alike. Each run starts the three
servers afresh and ends with its own budget table; ``--runs 3`` is the acceptance check.
Budgets: SQLite costs <= 10% output tok/s and <= 10% TTFT p50 at c=8; the gateway
adds <= 1 ms TTFT p50 at c=1, judged on ``--ttft-requests`` one-at-a-time requests that take
turns between the worker and the proxies in front of it (``peers/ttft.py``): a c=1 round's p50
of 8 requests moves more than the budget. The gateway and the worker share this machine's
cores, which a real deployment does not. The other budgets are judged on paired costs: each
round's measurement of a setup against the baseline's in the same round, seconds apart, and
the median over the rounds. The machine drifts by up to 30% within a run, both setups alike
(8 rounds: the memory store from 3,094 down to 2,166 tok/s), and a ratio of
neighbours cancels that where a ratio of the two setups' medians does not; the budget table
shows the latter in brackets.

Besides the client's view, each measurement records the CPU time the server process used per
output token (``psutil``, user + system): on a shared machine whose other load moves tok/s by
±25%, CPU per token moves much less, and it is what durable streams and the gateway add.
For the gateway it is the gateway process alone (the worker behind it costs what ``memory``
costs). Each round line also shows the API process's own share (the engine runs in a child
process): that is where a stream store's work lands.

At c=8 a round of 48 requests lasts about a second on the tiny checkpoint, and this machine's
speed swings by ±20% from one second to the next; 192 requests (~4 s a round) make the per-run
medians steady enough to judge a 10% budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import SERVED_NAME, Server, ServerSpec, free_ports, vlmserve_spec
from peers.settle import wait_idle
from peers.tables import Row, summarize
from peers.ttft import added_ms, interleaved_ttft
from serve import BenchConfig, Outcome, bodies_for, build_config, measure, requests_for, start
from serve import parse_args as serve_args

__all__ = ["budgets", "cpu_per_token", "main", "overhead_specs", "paired_costs"]

BASE, SQLITE, GATEWAY, BYTEPROXY = "memory", "sqlite", "gateway", "byteproxy"
GATEWAY_SESSIONS = "gateway-sessions"
PROXIES = (GATEWAY, GATEWAY_SESSIONS, BYTEPROXY)  # in front of the memory worker
BUDGETS = {  # (setup, concurrency, metric): the most it may cost against the baseline
    (SQLITE, 8, "tok/s"): 0.10,
    (SQLITE, 8, "ttft"): 0.10,
    (GATEWAY, 1, "ttft_ms"): 1.0,
    (GATEWAY, 8, "tok/s"): None,  # reported, no budget
    (GATEWAY_SESSIONS, 1, "ttft_ms"): None,  # the gateway's own sessions, reported
    (GATEWAY_SESSIONS, 8, "tok/s"): None,
    (BYTEPROXY, 1, "ttft_ms"): None,  # the floor under the gateway's budget, reported
}


@dataclass(slots=True)
class Sample:
    server: str
    concurrency: int
    round: int
    report: dict[str, Any]
    cpu_s: float  # the server process's CPU time (user + system) during the measurement
    own_cpu_s: float = 0.0  # of that, the server's own process (its engine process apart)


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
    proc = not cfg.in_process  # the workers' engines in their own processes (the default)
    memory = _renamed(vlmserve_spec(cfg.model_dir, ports[0], cfg.dtype, engine_process=proc), BASE)
    sqlite = _renamed(
        vlmserve_spec(cfg.model_dir, ports[1], cfg.dtype, engine_process=proc),
        SQLITE,
        VLMSERVE_PERSIST_SESSIONS="1",
        VLMSERVE_SESSIONS_DB_PATH=str(work / "sessions.db"),
    )
    registry = gateway_registry(work / "registry.toml", memory.url)
    gateway = _renamed(gateway_spec(cfg, ports[2], registry), GATEWAY)
    own = _renamed(
        gateway_spec(cfg, ports[4], registry),
        GATEWAY_SESSIONS,
        VLMSERVE_GATEWAY_PASSTHROUGH="false",
    )
    return [memory, sqlite, gateway, byteproxy_spec(ports[3], memory.url), own]


def gateway_spec(cfg: BenchConfig, port: int, registry: Path) -> ServerSpec:
    """A gateway over the registry's ``openai`` entry, no model of its own."""
    gateway = vlmserve_spec(cfg.model_dir, port, cfg.dtype)
    model_at = gateway.argv.index("--model")
    del gateway.argv[model_at : model_at + 4]  # no local model: --model DIR --served-model-name
    gateway.argv += ["--registry", str(registry)]
    return gateway


def byteproxy_spec(port: int, upstream: str) -> ServerSpec:
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "byteproxy:app",
        "--app-dir",
        str(Path(__file__).resolve().parent / "peers"),
        "--http",
        "httptools",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return ServerSpec(
        name=BYTEPROXY,
        argv=argv,
        port=port,
        model=SERVED_NAME,
        env={"BYTEPROXY_UPSTREAM": upstream},
    )


def _cpu_seconds(server: Server) -> tuple[float, float]:
    """User + system CPU time so far of the server process and its children, and of the
    process alone (the API's event loop and threads; the engine runs in a child)."""
    if server.proc is None:
        return 0.0, 0.0
    try:
        proc = psutil.Process(server.proc.pid)
        own = sum(proc.cpu_times()[:2])
        total = own + sum(sum(c.cpu_times()[:2]) for c in proc.children(recursive=True))
        return total, own
    except psutil.Error:
        return 0.0, 0.0


def run_rounds(
    specs: list[ServerSpec], cfg: BenchConfig, console: Console, ttft_requests: int = 0
) -> tuple[list[Sample], dict[str, list[float]]]:
    """Start every server, then measure round by round, the order rotating (module docstring);
    then, with ``ttft_requests``, the c=1 TTFT of the worker and the proxies in front of it,
    request by request in turn (``peers/ttft.py``)."""
    running: dict[str, Server] = {}
    samples: list[Sample] = []
    ttft: dict[str, list[float]] = {}
    out = Outcome()
    try:
        for spec in specs:
            server = start(spec, cfg, out, console)
            if server is None:
                raise SystemExit(f"{spec.name}: {out.status.get(spec.name)}")
            running[spec.name] = server
        for rnd in range(cfg.rounds):
            for c in cfg.concurrencies:
                shift = rnd % len(specs)
                for spec in specs[shift:] + specs[:shift]:
                    samples.append(_measure_one(running[spec.name], cfg, c, rnd, console))
        proxied = [s.name for s in specs if s.name in (BASE, *PROXIES)]
        if ttft_requests > 0 and len(proxied) > 1:
            wait_idle(cfg.settle)
            urls = {name: running[name].spec.url for name in proxied}
            ttft = asyncio.run(interleaved_ttft(urls, ttft_requests, SERVED_NAME))
            medians = (f"{name} {statistics.median(t):.2f} ms" for name, t in ttft.items() if t)
            console.print(f"TTFT p50, {ttft_requests} requests each: " + ", ".join(medians))
    finally:
        for server in running.values():
            server.stop()
    return samples, ttft


def _measure_one(server: Server, cfg: BenchConfig, c: int, rnd: int, console: Console) -> Sample:
    spec = server.spec
    wait_idle(cfg.settle)  # the previous setup's leftover work must not slow this one
    total, own = _cpu_seconds(server)
    bodies = bodies_for(spec, cfg, "short", ("measure", c, rnd), requests_for(cfg, c))
    report = measure(spec, cfg, bodies, c)
    after = _cpu_seconds(server)
    sample = Sample(spec.name, c, rnd, report, after[0] - total, after[1] - own)
    console.print(
        f"round {rnd + 1}/{cfg.rounds} c={c:<3} {spec.name:<8} "
        f"{report['output_throughput']:8.1f} tok/s  TTFT p50 {report['ttft_ms']['median']:7.1f} ms"
        f"  CPU {cpu_per_token([sample]):6.0f} us/token"
        f" (API process {cpu_per_token([sample], own=True):4.0f})  failed {report['failed']}"
    )
    return sample


def cpu_per_token(samples: list[Sample], own: bool = False) -> float:
    """Median over samples of the server's CPU microseconds per output token (``own``: of
    its own process alone)."""
    per = [
        (s.own_cpu_s if own else s.cpu_s) * 1e6 / max(1, int(s.report["total_output_tokens"]))
        for s in samples
    ]
    return statistics.median(per) if per else 0.0


def budgets(
    rows: list[Row],
    ttft: dict[str, list[float]] | None = None,
    paired: dict[tuple[str, int, str], float] | None = None,
) -> list[dict[str, Any]]:
    """Each budget: the measured cost against the baseline, and whether it holds. The cost is
    the median of the rounds' paired costs (``paired_costs``) where there are some, else that
    of the setups' medians (also kept, as ``cost_of_medians``). The TTFT a proxy adds at c=1
    comes from the interleaved requests (``ttft``) when there are some."""
    by = {(r.server, r.concurrency): r for r in rows}
    out = []
    for (setup, conc, metric), limit in BUDGETS.items():
        base, other = by.get((BASE, conc)), by.get((setup, conc))
        if base is None or other is None:
            continue
        of_medians = _cost(
            metric, base.output_tps, other.output_tps, base.ttft_p50_ms, other.ttft_p50_ms
        )
        interleaved = added_ms(ttft or {}, setup, BASE) if metric == "ttft_ms" else None
        cost = (paired or {}).get((setup, conc, metric), of_medians)
        cost = cost if interleaved is None else interleaved
        of_medians = of_medians if interleaved is None else None  # judged on other requests
        out.append(
            {
                "setup": setup,
                "concurrency": conc,
                "metric": metric,
                "cost": cost,
                "cost_of_medians": of_medians,
                "limit": limit,
                "ok": limit is None or cost <= limit,
            }
        )
    return out


def _cost(metric: str, base_tps: float, tps: float, base_ttft: float, ttft: float) -> float:
    if metric == "tok/s":
        return 1 - tps / base_tps
    if metric == "ttft":
        return ttft / base_ttft - 1
    return ttft - base_ttft  # ttft_ms: milliseconds added


def paired_costs(samples: list[Sample]) -> dict[tuple[str, int, str], float]:
    """Each budget's cost round by round against the baseline measured next to it in the same
    round, then the median over rounds. The machine drifts by up to 30% within a run (both
    setups alike); a round's two measurements are seconds apart, so their ratio cancels it."""
    by = {(s.server, s.concurrency, s.round): s.report for s in samples}
    out = {}
    for setup, conc, metric in BUDGETS:
        costs = []
        for (server, c, rnd), report in by.items():
            base = by.get((BASE, conc, rnd))
            if server == setup and c == conc and base is not None:
                tps, ttft = report["output_throughput"], report["ttft_ms"]["median"]
                costs.append(
                    _cost(metric, base["output_throughput"], tps, base["ttft_ms"]["median"], ttft)
                )
        if costs:
            out[(setup, conc, metric)] = statistics.median(costs)
    return out


def _table(rows: list[Row], cpu: dict[tuple[str, int], float], title: str) -> Table:
    table = Table(title=title)
    cols = (
        "setup",
        "conc",
        "out tok/s",
        "range",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "CPU us/token",
        "vs memory",
        "failed",
    )
    for col in cols:
        table.add_column(col, justify="right" if col != "setup" else "left")
    for r in rows:
        mine, base = cpu.get((r.server, r.concurrency), 0.0), cpu.get((BASE, r.concurrency), 0.0)
        table.add_row(
            r.server,
            str(r.concurrency),
            f"{r.output_tps:,.0f}",
            f"{r.output_tps_min:,.0f}-{r.output_tps_max:,.0f}",
            f"{r.ttft_p50_ms:.1f}",
            f"{r.tpot_p50_ms:.2f}",
            f"{mine:,.0f}",
            f"{mine / base:.2f}x" if base else "-",
            str(r.failed),
        )
    return table


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f} ms" if metric == "ttft_ms" else f"{value:+.1%}"


def _budget_table(runs: list[list[dict[str, Any]]]) -> Table:
    title = "budgets: cost against the memory-store worker, per run\n"
    table = Table(title=title + "(the rounds' paired costs' median; the medians' in brackets)")
    for col in (
        "setup",
        "conc",
        "metric",
        *(f"run {i + 1}" for i in range(len(runs))),
        "limit",
        "holds",
    ):
        table.add_column(col)
    for k, first in enumerate(runs[0]):
        checks = [run[k] for run in runs]
        held = sum(c["ok"] for c in checks)
        verdict = "-" if first["limit"] is None else f"{held}/{len(checks)}"
        table.add_row(
            first["setup"],
            str(first["concurrency"]),
            first["metric"],
            *(_cell(c) for c in checks),
            _fmt(first["metric"], first["limit"]),
            verdict if held == len(checks) else f"[red]{verdict}",
        )
    return table


def _cell(check: dict[str, Any]) -> str:
    metric, cost, of_medians = check["metric"], check["cost"], check.get("cost_of_medians")
    if of_medians is None or _fmt(metric, of_medians) == _fmt(metric, cost):
        return _fmt(metric, cost)
    return f"{_fmt(metric, cost)} ({_fmt(metric, of_medians)})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the tiny random-weight Qwen2-VL)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per run")
    p.add_argument("--runs", type=int, default=1, help="independent runs (servers restarted)")
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--setups",
        nargs="+",
        default=[BASE, SQLITE, GATEWAY, BYTEPROXY],
        choices=[BASE, SQLITE, GATEWAY, GATEWAY_SESSIONS, BYTEPROXY],
        help="which servers (memory always runs)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="the workers run their engines in their own process (--no-engine-process)",
    )
    p.add_argument(
        "--ttft-requests",
        type=int,
        default=60,
        help="after the rounds, this many one-at-a-time requests per setup to the worker and "
        "the proxies in front of it, taking turns request by request: the gateway's c=1 TTFT "
        "budget is judged on them (0: on the rounds' c=1 TTFT p50 instead)",
    )
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


def one_run(
    cfg: BenchConfig, console: Console, n: int, setups: list[str], ttft_requests: int = 0
) -> dict[str, Any]:
    """Start the servers, measure, stop them; the run's rows, CPU and budgets."""
    with tempfile.TemporaryDirectory(prefix="vlmserve-overhead-") as work:
        specs = overhead_specs(cfg, free_ports(5), Path(work))
        specs = [s for s in specs if s.name == BASE or s.name in setups]
        samples, ttft = run_rounds(specs, cfg, console, ttft_requests)
    rows = summarize([(s.server, s.concurrency, s.report) for s in samples])
    keys = dict.fromkeys((s.server, s.concurrency) for s in samples)
    cpu = {k: cpu_per_token([s for s in samples if (s.server, s.concurrency) == k]) for k in keys}
    console.print(_table(rows, cpu, f"run {n}: medians over {cfg.rounds} rounds"))
    return {
        "samples": [asdict(s) for s in samples],
        "summary": [asdict(r) for r in rows],
        "cpu_us_per_token": {f"{s}@{c}": v for (s, c), v in cpu.items()},
        "interleaved_ttft_ms": ttft,
        "budgets": budgets(rows, ttft, paired_costs(samples)),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    forwarded = [
        "--concurrency",
        *map(str, ns.concurrency),
        "--rounds",
        str(ns.rounds),
        "--requests",
        str(ns.requests),
        "--max-tokens",
        str(ns.max_tokens),
        "--no-sequential",
    ]
    forwarded += ["--in-process"] if ns.in_process else []
    cfg = build_config(serve_args(forwarded + (["--model", ns.model] if ns.model else [])))
    console = Console(width=None if sys.stdout.isatty() else 140)
    if not cfg.model_dir:
        from vlmserve.testing import build_qwen2_vl

        cfg.model_dir = str(build_qwen2_vl())
    runs = []
    for n in range(1, max(1, ns.runs) + 1):
        runs.append(one_run(cfg, console, n, ns.setups, ns.ttft_requests))
        console.print(f"load average after run {n}: {runs[-1]['load_average']}")
    console.print(_budget_table([run["budgets"] for run in runs]))
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps({"runs": runs}, indent=2))
        console.print(f"wrote {ns.json_path}")
    return 0 if all(c["ok"] for run in runs for c in run["budgets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
