"""TTFT as vLLM's client sees it: ``vllm bench serve`` beside ``benchmarks/serve.py``'s client.

    python benchmarks/vllm_bench.py                                   # tiny, c=1 and 8, 3 rounds
    python benchmarks/vllm_bench.py --size medium --json vllm_bench.json
    python benchmarks/vllm_bench.py --size tiny --concurrency 1 --requests 4 --rounds 1

One vlmserve serves the random-weight checkpoint of ``--size`` on a free loopback port. Two
clients drive it in turn with streamed text chats of a fixed output length (``ignore_eos``,
``--max-tokens``): ``serve.py``'s own (``peers/drive.py``: ``vlmserve.client``'s stream reader,
which times the first chunk that carries a token) and vLLM's (``vllm bench serve`` from the
peer venv, ``peers/vllm_client.py``, which times the first chunk with any ``choices``). A
server whose first chunk went out before the first token would show a far smaller TTFT to
vLLM's client than to ours; one whose first chunk carries the first token shows both the same.
The table gives both clients' TTFT p50 and mean per level and their ratio (vLLM-bench /
serve.py; the acceptance band is 0.9-1.1), with TPOT and ITL p50 for context.

Every measurement sends prompts new to the server (seeded per level, round and client), of
``--prompt-words`` random words each, so no prefix cache serves one client what the other
sent; both clients' prompt tokens per request are shown to confirm they send the same text.
Rounds interleave the clients, the order rotating each round, and each measurement starts
once the CPUs are idle (``peers/settle.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.drive import drive
from peers.rounds import config_json, fmt, medians, ratio, rotated
from peers.servers import SERVED_NAME, Server, free_ports, venv_python, vlmserve_spec
from peers.settle import wait_idle
from peers.vllm_client import BenchRun, run_bench, write_prompts
from peers.workloads import WORKLOADS, build_bodies
from serve import SIZES, default_peers_dir

__all__ = ["CLIENTS", "Config", "Sample", "main", "parse_args", "ratio_rows", "summarize"]

OURS = "serve.py"
VLLM = "vllm-bench"
CLIENTS = (OURS, VLLM)
BAND = (0.9, 1.1)  # acceptance: vLLM-bench's TTFT within 10% of serve.py's
METRICS = ("ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms", "itl_p50_ms", "input_tokens")


@dataclass(slots=True)
class Config:
    model_dir: str
    size: str
    dtype: str
    concurrencies: list[int]
    requests: int  # per measurement; 0: max(8, 2 x concurrency)
    prompt_words: int
    max_tokens: int
    rounds: int
    warmup: int
    settle: float
    peers_dir: Path
    log_dir: Path
    json_path: Path | None
    startup_timeout: float = 300.0
    client_timeout: float = 900.0
    seed: int = 0


@dataclass(slots=True)
class Sample:
    """One client's measurement at one level in one round (figures in ms)."""

    client: str
    concurrency: int
    round: int
    figures: dict[str, Any]
    settled_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # client -> why it was not measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the random-weight one of --size)")
    p.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    p.add_argument("--dtype", help="default: float32 for tiny, auto for medium")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (order rotates)")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests after the start")
    p.add_argument("--settle", type=float, default=15.0, help="max wait for idle CPUs (s)")
    p.add_argument("--peers-dir", help="peer venvs (default: $VLMSERVE_PEERS_DIR or ~/.cache/...)")
    p.add_argument("--log-dir", help="server and client logs, datasets, vLLM's result files")
    p.add_argument("--json", dest="json_path", help="write config, samples, summary and ratios")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_config(ns: argparse.Namespace) -> Config:
    if any(c < 1 for c in ns.concurrency) or min(ns.rounds, ns.max_tokens, ns.prompt_words) < 1:
        raise SystemExit("--concurrency, --rounds, --max-tokens and --prompt-words must be >= 1")
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
        prompt_words=ns.prompt_words,
        max_tokens=ns.max_tokens,
        rounds=ns.rounds,
        warmup=ns.warmup,
        settle=ns.settle,
        peers_dir=peers_dir,
        log_dir=Path(ns.log_dir) if ns.log_dir else peers_dir / "logs" / f"vllm-bench-{stamp}",
        json_path=Path(ns.json_path) if ns.json_path else None,
        seed=ns.seed,
    )


def requests_for(cfg: Config, concurrency: int) -> int:
    return cfg.requests if cfg.requests > 0 else max(8, 2 * concurrency)


def client_order(rnd: int) -> list[str]:
    """Both clients, the first one rotating with the round."""
    return rotated(CLIENTS, rnd)


def bodies_for(cfg: Config, model: str, key: tuple[object, ...], n: int) -> list[dict]:
    """``n`` streamed text chats as serve.py sends them (its ``short`` workload, no image)."""
    return build_bodies(
        WORKLOADS["short"],
        (cfg.seed, *key),
        requests=n,
        model=model,
        max_tokens=cfg.max_tokens,
        prompt_words=cfg.prompt_words,
        image=None,
        ignore_eos=True,
    )


def prompt_of(body: dict[str, Any]) -> str:
    """The text of a text-only chat body's one user message."""
    return str(body["messages"][0]["content"])


def figures_of(report: dict[str, Any]) -> dict[str, Any]:
    """serve.py's load report (``LoadReport.to_dict()``) under the names vLLM's is read into."""
    completed = int(report["completed"])
    return {
        "requests": int(report["requests"]),
        "completed": completed,
        "failed": int(report["failed"]),
        "ttft_p50_ms": float(report["ttft_ms"]["median"]),
        "ttft_mean_ms": float(report["ttft_ms"]["mean"]),
        "ttft_p99_ms": float(report["ttft_ms"]["p99"]),
        "tpot_p50_ms": float(report["tpot_ms"]["median"]),
        "itl_p50_ms": float(report["itl_ms"]["median"]),
        "itl_p99_ms": float(report["itl_ms"]["p99"]),
        "input_tokens": report["total_input_tokens"] / completed if completed else 0.0,
        "output_tps": float(report["output_throughput"]),
        "error": next(iter(report.get("error_examples", {}).values()), ""),
    }


def measure(
    cfg: Config, client: str, url: str, vllm_python: str, c: int, rnd: int
) -> dict[str, Any]:
    bodies = bodies_for(cfg, SERVED_NAME, ("measure", c, rnd, client), requests_for(cfg, c))
    if client == OURS:
        return figures_of(asyncio.run(drive(url, bodies, c)).to_dict())
    name = f"c{c}-r{rnd}"
    run = BenchRun(
        base_url=url,
        model=bodies[0]["model"],
        tokenizer=cfg.model_dir,
        max_tokens=cfg.max_tokens,
        concurrency=c,
        dataset=cfg.log_dir / f"prompts-{name}.jsonl",
        result=cfg.log_dir / f"vllm-bench-{name}.json",
        num_prompts=len(bodies),
    )
    write_prompts(run.dataset, [prompt_of(b) for b in bodies])
    return run_bench(vllm_python, run, cfg.log_dir / "vllm-bench.log", cfg.client_timeout)


def run_rounds(cfg: Config, url: str, vllm_python: str, console: Console) -> Outcome:
    out = Outcome()
    for rnd in range(cfg.rounds):
        for c in cfg.concurrencies:
            for client in client_order(rnd):
                if client in out.errors:
                    continue
                settled = wait_idle(cfg.settle)
                try:
                    figures = measure(cfg, client, url, vllm_python, c, rnd)
                except Exception as exc:  # reported in the table; the other client goes on
                    out.errors[client] = str(exc)
                    console.print(f"[red]{client}: {exc}")
                    continue
                out.samples.append(Sample(client, c, rnd, figures, round(settled, 2)))
                console.print(
                    f"round {rnd + 1}/{cfg.rounds} c={c:<3} {client:<10} "
                    f"TTFT p50 {figures['ttft_p50_ms']:8.2f} mean {figures['ttft_mean_ms']:8.2f} ms"
                    f"  TPOT p50 {figures['tpot_p50_ms']:6.2f} ms  {figures['input_tokens']:.1f} "
                    f"prompt tok/req  failed {figures['failed']}/{figures['requests']}"
                )
    return out


def summarize(samples: list[Sample]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (client, level): the median over rounds of each of ``METRICS``, and failures."""
    return medians((((s.client, s.concurrency), s.figures) for s in samples), METRICS)


def ratio_rows(summary: dict[tuple[str, int], dict[str, float]]) -> list[dict[str, Any]]:
    """Per level: both clients' figures, vLLM-bench / serve.py of TTFT p50 and mean, and
    whether both ratios lie within ``BAND``."""
    rows = []
    for c in sorted({level for _, level in summary}):
        ours, theirs = summary.get((OURS, c)), summary.get((VLLM, c))
        if ours is None or theirs is None:
            continue
        p50 = ratio(theirs["ttft_p50_ms"], ours["ttft_p50_ms"])
        mean = ratio(theirs["ttft_mean_ms"], ours["ttft_mean_ms"])
        within = all(r is not None and BAND[0] <= r <= BAND[1] for r in (p50, mean))
        rows.append(
            {
                "concurrency": c,
                OURS: ours,
                VLLM: theirs,
                "ttft_p50_ratio": p50,
                "ttft_mean_ratio": mean,
                "within_10pct": within,
            }
        )
    return rows


def ratio_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="TTFT by client: vLLM-bench / serve.py (acceptance 0.90-1.10)")
    table.add_column("conc", justify="right")
    for client in CLIENTS:
        for name in ("TTFT p50", "TTFT mean"):
            table.add_column(f"{client} {name} ms", justify="right")
    for name in ("p50 ratio", "mean ratio", "within 10%"):
        table.add_column(name, justify="right")
    for client in CLIENTS:
        table.add_column(f"{client} TPOT / ITL p50 ms", justify="right")
    table.add_column("prompt tok/req", justify="right")
    for r in rows:
        ours, theirs = r[OURS], r[VLLM]
        table.add_row(
            str(r["concurrency"]),
            *(fmt(x[m]) for x in (ours, theirs) for m in ("ttft_p50_ms", "ttft_mean_ms")),
            fmt(r["ttft_p50_ratio"], ".3f"),
            fmt(r["ttft_mean_ratio"], ".3f"),
            "yes" if r["within_10pct"] else "[red]no",
            *(f"{fmt(x['tpot_p50_ms'])} / {fmt(x['itl_p50_ms'])}" for x in (ours, theirs)),
            f"{fmt(ours['input_tokens'], '.1f')} / {fmt(theirs['input_tokens'], '.1f')}",
        )
    return table


def start_server(cfg: Config, console: Console) -> Server:
    spec = vlmserve_spec(cfg.model_dir, free_ports(1)[0], cfg.dtype)
    server = Server(spec, cfg.log_dir)
    console.print(f"starting vlmserve on :{spec.port} (log {server.log_path})")
    server.start(cfg.startup_timeout)
    if cfg.warmup:
        bodies = bodies_for(cfg, spec.model, ("warmup",), cfg.warmup)
        asyncio.run(drive(spec.url, bodies, min(8, cfg.warmup)))
    return server


def to_json(cfg: Config, out: Outcome, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "config": config_json(cfg),
        "samples": [asdict(s) for s in out.samples],
        "ratios": rows,
        "errors": out.errors,
    }


def main(argv: list[str] | None = None) -> int:
    cfg = build_config(parse_args(argv))
    console = Console(width=None if sys.stdout.isatty() else 160)
    vllm_python, missing = venv_python(cfg.peers_dir, "vllm", "vllm", "install_vllm.sh")
    if missing:
        console.print(f"[red]vLLM's client is not installed: {missing}")
        return 1
    if not cfg.model_dir:
        from vlmserve.testing import build_qwen2_vl

        cfg.model_dir = str(build_qwen2_vl(SIZES[cfg.size]()))
    server = start_server(cfg, console)
    try:
        out = run_rounds(cfg, server.spec.url, vllm_python, console)
    finally:
        server.stop()
    rows = ratio_rows(summarize(out.samples))
    console.print(ratio_table(rows))
    for client, why in out.errors.items():
        console.print(f"[red]{client}: not measured: {why}")
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(to_json(cfg, out, rows), indent=2))
        console.print(f"wrote {cfg.json_path}")
    return 0 if rows and not out.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
