"""Rerank throughput: query-document pairs per second, batched vs one pair per forward.

    python benchmarks/rerank.py                          # tiny jina-reranker-m0 layout, CPU
    python benchmarks/rerank.py --kind qwen3 --pairs 64 --doc-words 120
    python benchmarks/rerank.py --model jinaai/jina-reranker-m0 --device cuda
    python benchmarks/rerank.py --http --peer vllm       # both servers' /v1/rerank too

In process, both modes score the same pairs through the same path, ``HFRerankBackend``'s
``score_sync`` (packed prefill-only rows on the batched engine's model code): *batched* packs
them into forwards of ``--max-batch`` pairs (what ``/v1/rerank`` does with one request's
documents, and with concurrent requests' pairs); *one at a time* calls it once per pair.
``--http`` also times our ``/v1/rerank`` (a server in this process) with all documents in one
request and with one document per request. ``--peer vllm`` starts vLLM
(``~/.cache/vlmserve/peers/vllm``, see ``benchmarks/peers/install_vllm.sh``) on the same
checkpoint, times its ``/v1/rerank`` the same two ways, and reports the largest difference
between its scores and ours. On a shared CPU, ``--threads 1`` keeps torch's thread team from
spinning against other processes. Results print as a table and, with ``--json``, are
written to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
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
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--http", action="store_true", help="also time our /v1/rerank")
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


def ours(
    args: argparse.Namespace, source: str, query: str, docs: list[str], scores: list[float]
) -> dict[str, float]:
    """Our rates in process; ``scores`` receives our score of each document."""
    config = RerankConfig.defaults(max_batch=args.max_batch)
    options = LoadOptions(source=source, device=args.device, dtype=args.dtype)
    backend = HFRerankBackend("bench", options, config=config)
    backend.load()
    pairs = [ScorePair(EmbedInput(query), EmbedInput(d)) for d in docs]
    try:
        scores.extend(backend.score_sync(pairs).scores)
        batched = best_rate(lambda: backend.score_sync(pairs), len(pairs), args.repeat)
        single = best_rate(
            lambda: [backend.score_sync([p]) for p in pairs], len(pairs), args.repeat
        )
    finally:
        backend.close()
    return {"vlmserve batched": batched, "vlmserve one at a time": single}


def over_http(
    name: str, base_url: str, query: str, docs: list[str], ours: list[float], repeat: int
) -> dict[str, float]:
    """``/v1/rerank`` with every document in one request, then one document a request (one
    kept-alive connection, as a client with a session sends them); and the largest difference
    between the server's scores and ``ours``."""
    with httpx.Client(base_url=base_url, timeout=600) as client:

        def post(batch: list[str]) -> dict[str, Any]:
            body = {"model": SERVED_NAME, "query": query, "documents": batch}
            answer = client.post("/v1/rerank", json=body)
            answer.raise_for_status()
            return answer.json()  # type: ignore[no-any-return]

        theirs = {r["index"]: r["relevance_score"] for r in post(docs)["results"]}
        differs = max(abs(theirs[i] - score) for i, score in enumerate(ours))
        together = best_rate(lambda: post(docs), len(docs), repeat)
        alone = best_rate(lambda: [post([d]) for d in docs], len(docs), repeat)
    return {
        f"{name} /v1/rerank, all in one request": together,
        f"{name} /v1/rerank, one per request": alone,
        f"max |{name} score - in process|": differs,
    }


def ours_http(
    args: argparse.Namespace, source: str, query: str, docs: list[str], ours: list[float]
) -> dict[str, float]:
    """Our server (uvicorn in a thread of this process) holding the reranker alone."""
    import threading

    import uvicorn

    from vlmserve.api.app import build_app
    from vlmserve.config import ModelConfig, Settings

    model = ModelConfig(name=SERVED_NAME, source=source, roles=["rerank"])
    limits = {"rerank_max_batch_size": args.max_batch, "ui": False}
    settings = Settings(device=args.device, dtype=args.dtype, models=[model], **limits)
    port = free_ports(1)[0]
    config = uvicorn.Config(build_app(settings), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url)
        return over_http("vlmserve", url, query, docs, ours, args.repeat)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise StartError(f"{url} not ready after {timeout:.0f} s")


def peer(
    args: argparse.Namespace, source: str, query: str, docs: list[str], ours: list[float]
) -> dict[str, float]:
    """The peer's ``/v1/rerank`` on the same checkpoint."""
    spec = PEERS[args.peer](source, free_ports(1)[0], args.dtype, Path(args.peers_dir))
    if spec.missing:
        raise StartError(spec.missing)
    server = Server(spec, Path(tempfile.mkdtemp(prefix="rerank-peer-")))
    server.start(timeout=600)
    try:
        return over_http(args.peer, spec.url, query, docs, ours, args.repeat)
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    console = Console()
    source = model_dir(args)
    query = "a dog running in the park at night"
    docs = documents(args.pairs, args.doc_words)
    if args.threads:
        torch.set_num_threads(args.threads)
    scores: list[float] = []
    rates = ours(args, source, query, docs, scores)
    if args.http:
        rates.update(ours_http(args, source, query, docs, scores))
    if args.peer:
        try:
            rates.update(peer(args, source, query, docs, scores))
        except (StartError, httpx.HTTPError) as exc:
            console.print(f"[yellow]{args.peer} not measured:[/] {exc}")
    table = Table(title=f"{args.pairs} pairs, {args.doc_words} words a document, {source}")
    table.add_column("mode")
    table.add_column("pairs/s", justify="right")
    for mode, rate in rates.items():
        table.add_row(mode, f"{rate:.2e}" if mode.startswith("max") else f"{rate:.1f}")
    console.print(table)
    speedup = rates["vlmserve batched"] / rates["vlmserve one at a time"]
    console.print(f"in process, batched / one at a time: {speedup:.2f}x")
    one_request = rates.get("vlmserve /v1/rerank, all in one request")
    http = one_request / rates["vlmserve /v1/rerank, one per request"] if one_request else None
    if http:
        console.print(f"/v1/rerank, all in one request / one per request: {http:.2f}x")
    if args.json:
        result = {"args": vars(args), "pairs_per_s": rates, "speedup": speedup, "http": http}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
