"""What chunked prefill does for the streams already running when a long prompt arrives.

    python benchmarks/long_prompt.py                      # medium checkpoint
    python benchmarks/long_prompt.py --size tiny --chunk 256

Two engines on the same checkpoint in this process: one prefills a prompt whole
(``max_num_batched_tokens`` above its length), the other in chunks of ``--chunk`` tokens.
In each, ``--streams`` short requests decode; once they run, a prompt of about
``--prompt-words`` words arrives. Reported, side by side: the longest pause between two
tokens of the running streams (the stall the long prefill causes), the long request's time to
first token, and whether every answer is the same in both engines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import SIZES

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart
from vlmserve.testing.tiny import build_qwen2_vl

WORDS = "the quick brown fox jumps over the lazy dog while the river runs to the sea "


def ask(text: str, max_tokens: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest("b", [ChatMessage("user", [TextPart(text)])], params)


async def timed(backend: HFChatBackend, req: GenerateRequest) -> tuple[list[float], list[int]]:
    """(arrival time of each token, the tokens)."""
    stamps, tokens = [], []
    prepared = await backend.prepare(req)
    async for chunk in backend.generate(prepared):
        stamps += [time.perf_counter()] * len(chunk.token_ids)
        tokens += chunk.token_ids
    return stamps, tokens


async def scenario(backend: HFChatBackend, ns: argparse.Namespace) -> dict[str, Any]:
    engine = backend.engine
    assert engine is not None
    streams = [
        asyncio.ensure_future(timed(backend, ask(f"Stream {i}: count.", ns.tokens)))
        for i in range(ns.streams)
    ]
    while engine.running < ns.streams or engine.steps < 3:
        await asyncio.sleep(0.001)
    long = ask(WORDS * max(1, ns.prompt_words // len(WORDS.split())), 4)
    began = time.perf_counter()
    long_stamps, long_tokens = await timed(backend, long)
    done = await asyncio.gather(*streams)
    gaps = [b - a for stamps, _ in done for a, b in itertools.pairwise(stamps)]
    return {
        "stall": max(gaps),
        "ttft": long_stamps[0] - began,
        "answers": [t for _, t in done] + [long_tokens],
    }


async def run(ns: argparse.Namespace, console: Console) -> None:
    options = LoadOptions(
        source=str(build_qwen2_vl(SIZES[ns.size]())), device="cpu", dtype=ns.dtype
    )
    engines = {"whole": 1 << 20, "chunked": ns.chunk}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for rnd in range(ns.rounds):
        for name in engines if rnd % 2 == 0 else reversed(list(engines)):
            backend = HFChatBackend(
                name,
                options,
                max_model_len=1 << 20,
                max_num_seqs=16,
                max_num_batched_tokens=engines[name],
            )
            backend.load()
            try:
                results[name].append(await scenario(backend, ns))
            finally:
                backend.close()
            got = results[name][-1]
            console.print(
                f"round {rnd + 1} {name:7} stall {1000 * got['stall']:8.1f} ms  "
                f"long TTFT {1000 * got['ttft']:8.1f} ms"
            )
    console.print(table(results, ns))


def table(results: dict[str, list[dict[str, Any]]], ns: argparse.Namespace) -> Table:
    def best(name: str, key: str) -> float:
        return 1000 * min(r[key] for r in results[name])

    same = all(
        w["answers"] == c["answers"]
        for w, c in zip(results["whole"], results["chunked"], strict=True)
    )
    t = Table(
        title=f"a {ns.prompt_words}-word prompt arriving while {ns.streams} streams decode "
        f"({ns.size}, chunks of {ns.chunk})"
    )
    for column in ("setup", "longest pause of a stream", "long prompt TTFT", "same answers"):
        t.add_column(column, justify="right")
    for name in results:
        t.add_row(
            name,
            f"{best(name, 'stall'):.1f} ms",
            f"{best(name, 'ttft'):.1f} ms",
            "yes" if same else "no",
        )
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-words", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens when chunked")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens per running stream")
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run(parse_args(argv), Console()))


if __name__ == "__main__":
    main()
