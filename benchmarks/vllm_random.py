"""Long prompts under vLLM's own client: ``vllm bench serve``'s random dataset against vlmserve
and vLLM-CPU, side by side.

    python benchmarks/vllm_random.py                          # medium, 2,000 tokens, c=4 and 8
    python benchmarks/vllm_random.py --rounds 3 --json vllm_random.json
    python benchmarks/vllm_random.py --size tiny --input-len 256 --concurrency 1 --requests 4

Each server in turn (the order rotating each round) serves the random-weight checkpoint of
``--size`` on a free loopback port and is driven by ``vllm bench serve --dataset-name random``
(``--random-input-len``, ``--random-range-ratio 0``: every prompt exactly ``--input-len``
tokens; ``--ignore-eos`` with ``--max-tokens`` out; at most ``--concurrency`` in flight, all
sent at once). Both servers get the same prompts (one seed per level and round), new to
them, so every prompt is prefilled cold. A short warm-up run follows each start, and each
measurement begins once the CPUs are idle (``peers/settle.py``).

The table gives, per level, the median over rounds of each server's TTFT p50, TPOT p50,
inter-token latency p50 and p99 and output tokens/s, and our ratio to vLLM's; the ITL
columns are marked against the engine's targets (p50 <= 1.2x, p99 <= 2x vLLM's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.rounds import config_json, fmt, medians, ratio, rotated
from peers.servers import (
    SERVED_NAME,
    VLMSERVE,
    Server,
    ServerSpec,
    StartError,
    free_ports,
    venv_python,
    vllm_spec,
    vlmserve_spec,
)
from peers.settle import wait_idle
from peers.vllm_client import BenchRun, run_bench
from serve import SIZES, default_peers_dir

__all__ = ["Config", "Sample", "main", "parse_args", "ratio_rows", "summarize"]

VLLM = "vllm"
SERVERS = (VLMSERVE, VLLM)
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "output_tps", "input_tokens")
TARGETS = {"itl_p50_ms": 1.2, "itl_p99_ms": 2.0}  # ours / vLLM's, at most


@dataclass(slots=True)
class Config:
    model_dir: str
    size: str
    dtype: str
    concurrencies: list[int]
    requests: int  # per measurement; 0: max(8, 2 x concurrency)
    input_len: int
    max_tokens: int
    rounds: int
    warmup: int
    settle: float
    peers_dir: Path
    log_dir: Path
    json_path: Path | None
    startup_timeout: float = 600.0
    client_timeout: float = 1800.0
    seed: int = 0


@dataclass(slots=True)
class Sample:
    """One server's measurement at one level in one round (figures in ms, tok/s)."""

    server: str
    concurrency: int
    round: int
    figures: dict[str, Any]
    settled_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # server -> why it was not measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the random-weight one of --size)")
    p.add_argument("--size", choices=["tiny", "medium"], default="medium")
    p.add_argument("--dtype", help="default: float32 for tiny, each server's own (auto) else")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument("--input-len", type=int, default=2000, help="prompt tokens of every request")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--rounds", type=int, default=1, help="rounds (the server order rotates)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests after each start")
    p.add_argument("--settle", type=float, default=15.0, help="max wait for idle CPUs (s)")
    p.add_argument("--peers-dir", help="peer venvs (default: $VLMSERVE_PEERS_DIR or ~/.cache/...)")
    p.add_argument("--log-dir", help="server and client logs, vLLM's result files")
    p.add_argument("--json", dest="json_path", help="write config, samples and ratios here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_config(ns: argparse.Namespace) -> Config:
    if any(c < 1 for c in ns.concurrency) or min(ns.rounds, ns.max_tokens, ns.input_len) < 1:
        raise SystemExit("--concurrency, --rounds, --max-tokens and --input-len must be >= 1")
    if ns.requests < 0 or ns.warmup < 0:
        raise SystemExit("--requests and --warmup must be at least 0")
    peers_dir = Path(ns.peers_dir) if ns.peers_dir else default_peers_dir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Config(
        model_dir=ns.model or "",
        size=ns.size,
        dtype=ns.dtype or ("auto" if ns.size == "medium" and not ns.model else "float32"),
        concurrencies=list(dict.fromkeys(ns.concurrency)),
        requests=ns.requests,
        input_len=ns.input_len,
        max_tokens=ns.max_tokens,
        rounds=ns.rounds,
        warmup=ns.warmup,
        settle=ns.settle,
        peers_dir=peers_dir,
        log_dir=Path(ns.log_dir) if ns.log_dir else peers_dir / "logs" / f"vllm-random-{stamp}",
        json_path=Path(ns.json_path) if ns.json_path else None,
        seed=ns.seed,
    )


def requests_for(cfg: Config, concurrency: int) -> int:
    return cfg.requests if cfg.requests > 0 else max(8, 2 * concurrency)


def server_order(rnd: int) -> list[str]:
    """Both servers, the first one rotating with the round."""
    return rotated(SERVERS, rnd)


def level_seed(cfg: Config, concurrency: int, rnd: int) -> int:
    """The random dataset's seed of one level in one round: the same for both servers, new
    for every level and round (no prompt is ever sent twice to one server)."""
    return cfg.seed * 1_000_003 + rnd * 1009 + concurrency


def warmup_seed(cfg: Config, rnd: int) -> int:
    """The warm-up's seed: apart from every level's."""
    return cfg.seed * 1_000_003 + 500_000 + rnd


def bench_run(cfg: Config, url: str, name: str, concurrency: int, n: int, seed: int) -> BenchRun:
    return BenchRun(
        base_url=url,
        model=SERVED_NAME,
        tokenizer=cfg.model_dir,
        max_tokens=cfg.max_tokens,
        concurrency=concurrency,
        dataset=cfg.log_dir / "unused.jsonl",
        result=cfg.log_dir / f"{name}.json",
        num_prompts=n,
        random_input_len=cfg.input_len,
        seed=seed,
    )


def spec_for(cfg: Config, server: str) -> ServerSpec:
    port = free_ports(1)[0]
    if server == VLLM:
        return vllm_spec(cfg.model_dir, port, cfg.dtype, cfg.peers_dir)
    return vlmserve_spec(cfg.model_dir, port, cfg.dtype)


def measure_server(
    cfg: Config, server: str, rnd: int, vllm_python: str, console: Console
) -> list[Sample]:
    """Start ``server``, warm it, run every level once, stop it."""
    spec = spec_for(cfg, server)
    if spec.missing:
        raise StartError(spec.missing)
    running = Server(spec, cfg.log_dir)
    console.print(f"round {rnd + 1}: starting {server} on :{spec.port} (log {running.log_path})")
    running.start(cfg.startup_timeout)
    log = cfg.log_dir / f"bench-{server}.log"
    samples = []
    try:
        if cfg.warmup:
            warm = bench_run(
                cfg,
                spec.url,
                f"{server}-r{rnd}-warmup",
                cfg.warmup,
                cfg.warmup,
                warmup_seed(cfg, rnd),
            )
            run_bench(vllm_python, warm, log, cfg.client_timeout)
        for c in cfg.concurrencies:
            settled = wait_idle(cfg.settle)
            run = bench_run(
                cfg,
                spec.url,
                f"{server}-c{c}-r{rnd}",
                c,
                requests_for(cfg, c),
                level_seed(cfg, c, rnd),
            )
            figures = run_bench(vllm_python, run, log, cfg.client_timeout)
            samples.append(Sample(server, c, rnd, figures, round(settled, 2)))
            console.print(
                f"  c={c:<3} TTFT p50 {figures['ttft_p50_ms']:9.1f} ms  TPOT p50 "
                f"{figures['tpot_p50_ms']:7.2f}  ITL p50 {figures['itl_p50_ms']:7.2f} p99 "
                f"{figures['itl_p99_ms']:8.2f} ms  {figures['output_tps']:7.1f} tok/s  "
                f"{figures['input_tokens']:.0f} prompt tok/req  failed {figures['failed']}"
            )
    finally:
        running.stop()
    return samples


def run_rounds(cfg: Config, vllm_python: str, console: Console) -> Outcome:
    out = Outcome()
    for rnd in range(cfg.rounds):
        for server in server_order(rnd):
            if server in out.errors:
                continue
            try:
                out.samples += measure_server(cfg, server, rnd, vllm_python, console)
            except (StartError, RuntimeError, ValueError) as exc:  # the other server goes on
                out.errors[server] = str(exc)
                console.print(f"[red]{server}: {exc}")
    return out


def summarize(samples: list[Sample]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (server, level): the median over rounds of each of ``METRICS``, and failures."""
    return medians((((s.server, s.concurrency), s.figures) for s in samples), METRICS)


def ratio_rows(summary: dict[tuple[str, int], dict[str, float]]) -> list[dict[str, Any]]:
    """Per level: both servers' figures, ours / vLLM's of each metric, and whether the ITL
    ratios meet ``TARGETS``."""
    rows = []
    for c in sorted({level for _, level in summary}):
        ours, theirs = summary.get((VLMSERVE, c)), summary.get((VLLM, c))
        if ours is None or theirs is None:
            continue
        ratios = {m: ratio(ours[m], theirs[m]) for m in METRICS if m != "input_tokens"}
        meets = {
            m: ratios[m] is not None and ratios[m] <= limit  # type: ignore[operator]
            for m, limit in TARGETS.items()
        }
        rows.append(
            {"concurrency": c, VLMSERVE: ours, VLLM: theirs, "ratios": ratios, "meets": meets}
        )
    return rows


COLUMNS = {
    "ttft_p50_ms": "TTFT p50 ms",
    "tpot_p50_ms": "TPOT p50 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
    "output_tps": "out tok/s",
}


def ratio_table(rows: list[dict[str, Any]], cfg: Config) -> Table:
    title = (
        f"vllm bench serve, random dataset, {cfg.input_len} prompt tokens, {cfg.max_tokens} out: "
        f"vlmserve / vLLM (ITL targets: p50 <= {TARGETS['itl_p50_ms']}x, p99 <= "
        f"{TARGETS['itl_p99_ms']}x)"
    )
    table = Table(title=title)
    table.add_column("conc", justify="right")
    for name in COLUMNS.values():
        table.add_column(f"{name}\nours / vLLM", justify="right")
        table.add_column("ratio", justify="right")
    table.add_column("prompt tok/req", justify="right")
    for r in rows:
        ours, theirs, ratios = r[VLMSERVE], r[VLLM], r["ratios"]
        cells = [str(r["concurrency"])]
        for m in COLUMNS:
            spec = ".1f" if m in ("ttft_p50_ms", "output_tps") else ".2f"
            cells.append(f"{fmt(ours[m], spec)} / {fmt(theirs[m], spec)}")
            mark = "" if m not in TARGETS else (" ok" if r["meets"][m] else " [red]over")
            cells.append(f"{fmt(ratios[m], '.2f')}{mark}")
        cells.append(f"{ours['input_tokens']:.0f} / {theirs['input_tokens']:.0f}")
        table.add_row(*cells)
    return table


def to_json(cfg: Config, out: Outcome, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "config": config_json(cfg),
        "samples": [asdict(s) for s in out.samples],
        "ratios": rows,
        "errors": out.errors,
    }


def main(argv: list[str] | None = None) -> int:
    cfg = build_config(parse_args(argv))
    console = Console(width=None if sys.stdout.isatty() else 200)
    vllm_python, missing = venv_python(cfg.peers_dir, "vllm", "vllm", "install_vllm.sh")
    if missing:
        console.print(f"[red]vLLM is not installed: {missing}")
        return 1
    if not cfg.model_dir:
        from vlmserve.testing import build_qwen2_vl

        cfg.model_dir = str(build_qwen2_vl(SIZES[cfg.size]()))
    out = run_rounds(cfg, vllm_python, console)
    rows = ratio_rows(summarize(out.samples))
    console.print(ratio_table(rows, cfg))
    for server, why in out.errors.items():
        console.print(f"[red]{server}: not measured: {why}")
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(to_json(cfg, out, rows), indent=2))
        console.print(f"wrote {cfg.json_path}")
    return 0 if rows and not out.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
