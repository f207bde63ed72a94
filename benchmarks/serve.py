"""Side-by-side serving benchmark: vlmserve against vLLM (CPU build) and ``transformers serve``.

    python benchmarks/serve.py                                  # vlmserve batched vs one-at-a-time
    python benchmarks/serve.py --peer vllm --rounds 3 --json out.json
    python benchmarks/serve.py --peer vllm --peer transformers-serve --concurrency 1 8
    python benchmarks/serve.py --peer vllm --size medium --concurrency 1 8   # ~100M params, bf16
    python benchmarks/serve.py --size medium --workload short long photo video

Every server serves the same checkpoint (default: the tiny random-weight Qwen2-VL) on a free
loopback port and is driven by the same client (``vlmserve.client``'s streaming reader and
statistics) with requests of a fixed output length, of one or more workloads
(``peers/workloads.py``: short, long, photo, video); every request's prompt and media are new
to the server (seeded per workload, warm-up, level, round and request), so prefix and media
caches only serve what real traffic would let them. Measurements are interleaved: each round
visits every workload and concurrency level and, within it, every server in turn (the order
rotates per round), so slow drift of the machine hits all servers alike. Only one server is
under load at a time; the others sit idle (or are stopped, with ``--one-at-a-time``), and
each measurement starts once the CPUs are idle (``--settle``: a server that keeps polling
after its load would slow the next one). Peers live in their own venvs
(``benchmarks/peers/``); a peer that is missing or fails to start is reported as such, never
silently skipped. Besides TTFT and TPOT the tables give inter-token latency (ITL) p50/p99:
the gaps between consecutive token chunks of each stream, pooled over the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.cache import CacheCheck, cache_table, run_cache_check
from peers.drive import drive
from peers.servers import (
    PEERS,
    VLMSERVE,
    VLMSERVE_ONE,
    BodyRewrite,
    Server,
    ServerSpec,
    free_ports,
    vlmserve_spec,
)
from peers.settle import wait_idle
from peers.tables import Row, ratio_rows, render, summarize
from peers.workloads import WORKLOADS, build_bodies, media_tokens, words_for_tokens


def _medium() -> Any:
    """``vlmserve.testing.medium``: ~100M parameters in bfloat16, Qwen2-VL's real media bounds."""
    from vlmserve.testing.medium import medium_spec

    return medium_spec()


def _tiny() -> Any:
    from vlmserve.testing.tiny import TinySpec

    return TinySpec()


SIZES = {"tiny": _tiny, "medium": _medium}

__all__ = ["BenchConfig", "Sample", "build_config", "main", "parse_args", "plan_specs"]


@dataclass(slots=True)
class BenchConfig:
    model_dir: str
    concurrencies: list[int]
    rounds: int
    requests: int  # per measurement; 0 = auto (max(8, 2 x concurrency))
    warmup: int
    image: tuple[int, int] | None
    max_tokens: int
    prompt_words: int
    peers: list[str]
    sequential: bool  # also measure vlmserve with --max-num-seqs 1
    one_at_a_time: bool  # stop each server after its turn instead of leaving it idle
    dtype: str
    peers_dir: Path
    startup_timeout: float
    json_path: Path | None
    log_dir: Path
    seed: int = 0
    size: str = "tiny"  # the checkpoint built when model_dir is empty (SIZES)
    cache_image: tuple[int, int] | None = (448, 448)  # None: skip the media-cache check
    cache_max_pixels: int = 1280 * 28 * 28  # Qwen2-VL's documented cap (the tiny one: 224x224)
    cache_rounds: int = 3
    cache_requests: int = 12
    in_process: bool = False  # also measure vlmserve --no-engine-process
    settle: float = 15.0  # at most this long, wait for an idle machine before each measurement
    workloads: list[str] = field(default_factory=lambda: ["short"])  # peers/workloads.py
    long_words: int = 0  # words of the long workload (0: sized by the checkpoint's tokenizer)


@dataclass(slots=True)
class Sample:
    server: str
    concurrency: int
    round: int
    report: dict[str, Any]
    settled_s: float = 0.0  # waited for an idle machine before it (``peers/settle.py``)
    workload: str = "short"


@dataclass(slots=True)
class Outcome:
    status: dict[str, str] = field(default_factory=dict)  # server -> "ok" | why not measured
    commands: dict[str, list[str]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)


def parse_image(text: str) -> tuple[int, int] | None:
    if text.lower() in ("", "none", "0"):
        return None
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--image {text!r}: use WxH such as 64x64, or none"
        ) from None
    return w, h


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the random-weight Qwen2-VL of --size)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="checkpoint built when --model is not given: tiny (hidden 128, 2 layers, float32) or "
        "medium (hidden 1024, 8 layers, ~100M parameters, saved in bfloat16 like real Qwen2-VL)",
    )
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS), dest="peers")
    p.add_argument(
        "--workload",
        nargs="+",
        choices=list(WORKLOADS),
        default=["short"],
        dest="workloads",
        help="request mixes, each measured at every level: short (--prompt-words words + "
        "--image PNG), long (~2,000 tokens of text), photo (1280x960 JPEG + words), video "
        "(16 frames 448x448 at 2 fps + words)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per level")
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument(
        "--warmup", type=int, default=8, help="warm-up requests per workload after each start"
    )
    p.add_argument("--image", type=parse_image, default=(64, 64), help="WxH or none")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument(
        "--long-words",
        type=int,
        default=0,
        help="words of the long workload; 0: as many as make ~2,000 tokens with the checkpoint's "
        "tokenizer (1,500 with Qwen2-VL's, ~750 with the test checkpoints' small BPE)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="one dtype for every server; default: float32 for --size tiny, and each server's "
        "own default (auto) for --size medium (a bfloat16-saved checkpoint)",
    )
    p.add_argument("--no-sequential", action="store_true", help="skip vlmserve --max-num-seqs 1")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also measure vlmserve --no-engine-process (vlmserve-inproc)",
    )
    p.add_argument("--one-at-a-time", action="store_true", help="stop each server after its turn")
    p.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="before each measurement wait (at most this many seconds) until the CPUs are idle: "
        "vLLM's CPU build keeps a core busy for ~1 s after its load ends; 0: no wait",
    )
    p.add_argument("--peers-dir", help="peer venvs (default: $VLMSERVE_PEERS_DIR or ~/.cache/...)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", dest="json_path", help="write samples, summary and ratios here")
    p.add_argument("--log-dir", help="server logs (default: a temp dir under the peers dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-image",
        type=parse_image,
        default=(448, 448),
        help="WxH for the repeated-vs-new image TTFT check of vlmserve's media caches, or none",
    )
    p.add_argument(
        "--cache-max-pixels",
        type=int,
        default=1280 * 28 * 28,
        help="vlmserve --max-pixels for that check (default: Qwen2-VL's documented 1280*28*28)",
    )
    p.add_argument("--cache-rounds", type=int, default=3, help="cold/warm rounds of that check")
    p.add_argument("--cache-requests", type=int, default=12, help="requests per cold/warm round")
    return p.parse_args(argv)


def default_peers_dir() -> Path:
    env = os.environ.get("VLMSERVE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "vlmserve" / "peers"


def build_config(ns: argparse.Namespace) -> BenchConfig:
    if any(c < 1 for c in ns.concurrency) or ns.rounds < 1 or ns.max_tokens < 1:
        raise SystemExit("--concurrency, --rounds and --max-tokens must be at least 1")
    if ns.long_words < 0:
        raise SystemExit("--long-words must be at least 0")
    if ns.cache_rounds < 1 or ns.cache_requests < 1:
        raise SystemExit("--cache-rounds and --cache-requests must be at least 1")
    peers_dir = Path(ns.peers_dir) if ns.peers_dir else default_peers_dir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(ns.log_dir) if ns.log_dir else peers_dir / "logs" / stamp
    return BenchConfig(
        model_dir=ns.model or "",
        size=ns.size,
        concurrencies=list(dict.fromkeys(ns.concurrency)),
        rounds=ns.rounds,
        requests=ns.requests,
        warmup=ns.warmup,
        image=ns.image,
        max_tokens=ns.max_tokens,
        prompt_words=ns.prompt_words,
        peers=list(dict.fromkeys(ns.peers)),
        sequential=not ns.no_sequential,
        one_at_a_time=ns.one_at_a_time,
        dtype=ns.dtype or ("auto" if ns.size == "medium" and not ns.model else "float32"),
        peers_dir=peers_dir,
        startup_timeout=ns.startup_timeout,
        json_path=Path(ns.json_path) if ns.json_path else None,
        log_dir=log_dir,
        seed=ns.seed,
        cache_image=ns.cache_image,
        cache_rounds=ns.cache_rounds,
        cache_requests=ns.cache_requests,
        cache_max_pixels=ns.cache_max_pixels,
        in_process=ns.in_process,
        settle=ns.settle,
        workloads=list(dict.fromkeys(ns.workloads)),
        long_words=ns.long_words,
    )


def describe_workloads(cfg: BenchConfig, console: Console) -> None:
    """Size the long prompt with the checkpoint's tokenizer; print each workload's media
    tokens, counted by the checkpoint's own processor on the same media."""
    for workload in cfg.workloads:
        spec = WORKLOADS[workload]
        if spec.tokens and not cfg.long_words:
            cfg.long_words = words_for_tokens(cfg.model_dir, spec.tokens)
            console.print(f"{workload}: {cfg.long_words} words, ~{spec.tokens} text tokens")
        elif spec.tokens:
            console.print(f"{workload}: {cfg.long_words} words (--long-words)")
        if spec.image or spec.video_frames:
            tokens = media_tokens(cfg.model_dir, spec, cfg.image)
            console.print(f"{workload}: {tokens} visual tokens per request")


def plan_specs(cfg: BenchConfig, ports: list[int]) -> list[ServerSpec]:
    """vlmserve (batched), then vlmserve one-at-a-time, then each peer, one port each."""
    specs = [vlmserve_spec(cfg.model_dir, ports[0], cfg.dtype)]
    if cfg.sequential:
        specs.append(vlmserve_spec(cfg.model_dir, ports[len(specs)], cfg.dtype, max_num_seqs=1))
    if cfg.in_process:
        specs.append(
            vlmserve_spec(cfg.model_dir, ports[len(specs)], cfg.dtype, engine_process=False)
        )
    for name in cfg.peers:
        specs.append(PEERS[name](cfg.model_dir, ports[len(specs)], cfg.dtype, cfg.peers_dir))
    return specs


def requests_for(cfg: BenchConfig, concurrency: int) -> int:
    return cfg.requests if cfg.requests > 0 else max(8, 2 * concurrency)


def bodies_for(
    spec: ServerSpec, cfg: BenchConfig, workload: str, key: tuple[object, ...], requests: int
) -> list[dict[str, Any]]:
    """The requests of one measurement; ``key`` (phase, level, round) makes them new to every
    server, and the same for every server measured under it."""
    words = cfg.long_words if WORKLOADS[workload].tokens else cfg.prompt_words
    return build_bodies(
        WORKLOADS[workload],
        (cfg.seed, *key),
        requests=requests,
        model=spec.model,
        max_tokens=cfg.max_tokens,
        prompt_words=words,
        image=cfg.image,
        ignore_eos=spec.ignore_eos,
    )


def measure(
    spec: ServerSpec, cfg: BenchConfig, bodies: list[dict[str, Any]], concurrency: int
) -> dict[str, Any]:
    """Send ``bodies`` with at most ``concurrency`` in flight; the load report as a dict."""
    extra = spec.extra_body(cfg.max_tokens)
    transport = BodyRewrite(extra, connections=concurrency) if extra else None
    report = asyncio.run(drive(spec.url, bodies, concurrency, transport))
    return report.to_dict()


def start(
    spec: ServerSpec,
    cfg: BenchConfig,
    out: Outcome,
    console: Console,
    workloads: list[str] | None = None,
) -> Server | None:
    """Start ``spec`` and warm it up with ``--warmup`` requests of each of ``workloads``
    (default: every workload of the run)."""
    if spec.missing:
        out.status[spec.name] = f"not installed: {spec.missing}"
        console.print(f"[yellow]{spec.name}: {out.status[spec.name]}")
        return None
    server = Server(spec, cfg.log_dir)
    console.print(f"starting {spec.name} on :{spec.port} (log {server.log_path})")
    try:
        began = time.monotonic()
        server.start(cfg.startup_timeout)
        console.print(f"  ready in {time.monotonic() - began:.1f}s; warming up")
        for workload in (workloads or cfg.workloads) if cfg.warmup > 0 else []:
            bodies = bodies_for(spec, cfg, workload, ("warmup", spec.name), cfg.warmup)
            measure(spec, cfg, bodies, min(8, cfg.warmup))
    except Exception as exc:  # any failure is reported per server; the run goes on
        server.stop()
        out.status[spec.name] = f"failed to start: {exc}"
        console.print(f"[red]{spec.name}: {out.status[spec.name]}")
        return None
    out.status[spec.name] = "ok"
    return server


def run_rounds(specs: list[ServerSpec], cfg: BenchConfig, console: Console) -> Outcome:
    out = Outcome(commands={s.name: s.argv for s in specs})
    running: dict[str, Server] = {}
    try:
        for rnd in range(cfg.rounds):
            for workload in cfg.workloads:
                for c in cfg.concurrencies:
                    shift = rnd % len(specs)
                    for spec in specs[shift:] + specs[:shift]:
                        if out.status.get(spec.name, "ok") != "ok":
                            continue
                        if spec.name not in running:
                            # --one-at-a-time: a fresh server per turn, warmed for it only
                            only = [workload] if cfg.one_at_a_time else None
                            server = start(spec, cfg, out, console, only)
                            if server is None:
                                continue
                            running[spec.name] = server
                        sample = measure_one(spec, cfg, workload, c, rnd, console)
                        out.samples.append(sample)
                        if cfg.one_at_a_time:
                            running.pop(spec.name).stop()
    finally:
        for server in running.values():
            server.stop()
    return out


def measure_one(
    spec: ServerSpec, cfg: BenchConfig, workload: str, c: int, rnd: int, console: Console
) -> Sample:
    bodies = bodies_for(spec, cfg, workload, ("measure", c, rnd), requests_for(cfg, c))
    settled = wait_idle(cfg.settle)
    report = measure(spec, cfg, bodies, c)
    console.print(
        f"round {rnd + 1}/{cfg.rounds} {workload:<5} c={c:<3} {spec.name:<20} "
        f"{report['output_throughput']:8.1f} tok/s  "
        f"TTFT p50 {report['ttft_ms']['median']:7.1f} ms  "
        f"ITL p50 {report['itl_ms']['median']:6.1f} p99 {report['itl_ms']['p99']:7.1f} ms  "
        f"failed {report['failed']}/{report['requests']}  "
        f"(waited {settled:.1f}s for idle CPUs)"
    )
    return Sample(spec.name, c, rnd, report, round(settled, 2), workload)


def check_caches(spec: ServerSpec, cfg: BenchConfig, console: Console) -> CacheCheck | None:
    """TTFT of a repeated image against new ones, on a fresh vlmserve (caches empty)."""
    if cfg.cache_image is None:
        return None
    spec = replace(spec, argv=[*spec.argv, "--max-pixels", str(cfg.cache_max_pixels)])
    server = Server(spec, cfg.log_dir)
    console.print(f"media-cache check: starting {spec.name} on :{spec.port}")
    try:
        server.start(cfg.startup_timeout)
        return run_cache_check(
            spec.url,
            spec.model,
            cfg.cache_image,
            rounds=cfg.cache_rounds,
            requests=cfg.cache_requests,
            log=console.print,
        )
    except Exception as exc:  # reported, and the throughput results still print
        console.print(f"[red]media-cache check failed: {exc}")
        return None
    finally:
        server.stop()


def to_json(cfg: BenchConfig, out: Outcome, rows: list[Row], ratios: list[dict]) -> dict:
    config = asdict(cfg)
    config.update(peers_dir=str(cfg.peers_dir), log_dir=str(cfg.log_dir))
    config["json_path"] = str(cfg.json_path) if cfg.json_path else None
    return {
        "config": config,
        "servers": {
            name: {"status": state, "command": out.commands.get(name)}
            for name, state in out.status.items()
        },
        "samples": [asdict(s) for s in out.samples],
        "summary": [asdict(r) for r in rows],
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    cfg = build_config(parse_args(argv))
    console = Console(width=None if sys.stdout.isatty() else 132)  # logs: no 80-column wrap
    if not cfg.model_dir:
        from vlmserve.testing import build_qwen2_vl

        cfg.model_dir = str(build_qwen2_vl(SIZES[cfg.size]()))
    describe_workloads(cfg, console)
    if shutil.which("vlmserve") is None:
        console.print("[yellow]no `vlmserve` on PATH; using python -m vlmserve.cli.main")
    specs = plan_specs(cfg, free_ports(3 + len(cfg.peers)))
    out = run_rounds(specs, cfg, console)
    cache = check_caches(specs[0], cfg, console) if out.status.get(VLMSERVE) == "ok" else None
    rows = summarize([(s.server, s.concurrency, s.report, s.workload) for s in out.samples])
    ratios = ratio_rows(rows, VLMSERVE, [s.name for s in specs if s.name != VLMSERVE])
    render(console, rows, ratios, out.status, VLMSERVE_ONE)
    if cache is not None:
        console.print(cache_table(cache))
    if cfg.json_path:
        result = to_json(cfg, out, rows, ratios)
        result["media_cache"] = cache.to_dict() if cache is not None else None
        cfg.json_path.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {cfg.json_path}")
    return 0 if out.status.get(VLMSERVE) == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
