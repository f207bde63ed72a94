"""Interactive TTFT while a batch runs: does ``/v1/batches`` stay below interactive traffic?

    python benchmarks/batch_priority.py                       # tiny Qwen2-VL on CPU
    python benchmarks/batch_priority.py --model DIR --device cuda --rounds 5 --json out.json
    python benchmarks/batch_priority.py --batch-concurrency 1 2 4
    python benchmarks/batch_priority.py --batch-concurrency 4 --max-num-seqs 2   # rows scarce

One vlmserve (uvicorn on a free loopback port, in a thread) serves the checkpoint. Each round
measures, one request at a time, the TTFT of ``--requests`` streamed chat requests (one image,
``--max-tokens``) twice: idle, and while a batch of ``--batch-lines`` chat lines (the same
shape, ``--batch-max-tokens``) runs with ``batch_max_concurrency`` lines in flight; the batch is
cancelled after the measurement. Rounds interleave idle and busy so that drift of the machine
hits both. Output: per batch concurrency the median over rounds of the p50 TTFT idle and busy,
their ratio (the issue's target: <= 1.5), and the batch lines done during the busy part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table

from vlmserve.api.app import build_app
from vlmserve.client.loadtest import LoadConfig, run_load
from vlmserve.config import Settings
from vlmserve.testing import build_qwen2_vl
from vlmserve.testing.media import data_url, image_bytes

MODEL = "bench"
console = Console()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the tiny Qwen2-VL)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=12, help="interactive requests per measure")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--batch-lines", type=int, default=400)
    p.add_argument("--batch-max-tokens", type=int, default=32)
    p.add_argument("--batch-concurrency", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-num-seqs", type=int, help="rows decoded together (small: lines queue)")
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


class Server:
    """uvicorn serving ``app`` on a free port in a daemon thread."""

    def __init__(self, app: Any):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        while httpx.get(f"{url}/ready").status_code != 200:
            time.sleep(0.2)
        return url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def batch_file(lines: int, max_tokens: int) -> bytes:
    image = data_url(image_bytes(64, 64, seed=7), "image/png")
    out = []
    for i in range(lines):
        content = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": f"Describe picture number {i} in detail."},
        ]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        out.append(
            {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return "".join(json.dumps(o) + "\n" for o in out).encode()


async def p50_ttft(url: str, args: argparse.Namespace) -> float:
    cfg = LoadConfig(
        base_url=url,
        model=MODEL,
        concurrency=1,
        requests=args.requests,
        max_tokens=args.max_tokens,
        image=(64, 64),
        prompt_words=16,
    )
    report = await run_load(cfg)
    if report.failed:
        raise RuntimeError(f"interactive requests failed: {report.errors}")
    return report.ttft_ms.median


async def busy_ttft(
    http: httpx.AsyncClient, url: str, file_id: str, args: argparse.Namespace
) -> tuple[float, int]:
    """p50 TTFT while a batch runs; (ttft, batch lines done meanwhile)."""
    made = await http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    batch_id = made.json()["id"]
    while (await http.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"] < 1:
        await asyncio.sleep(0.05)  # the batch is under way
    before = (await http.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"]
    ttft = await p50_ttft(url, args)
    after = (await http.get(f"/v1/batches/{batch_id}")).json()
    await http.post(f"/v1/batches/{batch_id}/cancel")
    if after["status"] != "in_progress":
        console.print(
            f"[yellow]the batch ended ({after['status']}) during the measurement; "
            "use more --batch-lines[/]"
        )
    return ttft, after["request_counts"]["completed"] - before


async def measure(model_dir: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data:
        extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
        settings = Settings(
            model=model_dir,
            served_model_name=MODEL,
            device=args.device,
            files_dir=data,
            batch_max_concurrency=concurrency,
            files_max_bytes=60 * 2**20,
            **extra,
        )
        with Server(build_app(settings)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                upload = await http.post(
                    "/v1/files",
                    data={"purpose": "batch"},
                    files={
                        "file": ("b.jsonl", batch_file(args.batch_lines, args.batch_max_tokens))
                    },
                )
                file_id = upload.json()["id"]
                await p50_ttft(url, args)  # warm-up
                idle, busy, lines = [], [], []
                for _ in range(args.rounds):
                    idle.append(await p50_ttft(url, args))
                    ttft, done = await busy_ttft(http, url, file_id, args)
                    busy.append(ttft)
                    lines.append(done)
    row = {
        "batch_max_concurrency": concurrency,
        "idle_p50_ttft_ms": statistics.median(idle),
        "busy_p50_ttft_ms": statistics.median(busy),
        "idle_rounds": idle,
        "busy_rounds": busy,
        "batch_lines_done_while_measuring": lines,
    }
    row["ratio"] = row["busy_p50_ttft_ms"] / row["idle_p50_ttft_ms"]
    return row


def render(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="interactive TTFT p50 (ms): idle vs during a batch")
    for name in ("batch concurrency", "idle", "during batch", "ratio", "batch lines done"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            str(r["batch_max_concurrency"]),
            f"{r['idle_p50_ttft_ms']:.1f}",
            f"{r['busy_p50_ttft_ms']:.1f}",
            f"{r['ratio']:.2f}",
            str(sum(r["batch_lines_done_while_measuring"])),
        )
    return table


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model or str(build_qwen2_vl())
    rows = [await measure(model_dir, c, args) for c in args.batch_concurrency]
    console.print(render(rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": vars(args) | {"json": str(args.json)}, "rows": rows},
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
