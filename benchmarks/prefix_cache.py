"""What prefix caching saves: time to first token with a long shared system prompt, side by side.

    python benchmarks/prefix_cache.py                       # medium checkpoint, 2 rounds
    python benchmarks/prefix_cache.py --size tiny --image   # a second turn about one image

Two engines on the same checkpoint in this process, one with ``enable_prefix_caching``, take
the same requests one at a time, alternating round by round (so drift of the machine hits
both alike): a system prompt of about ``--system-words`` words, then a question of its own
(``--image``: every request is a follow-up turn about the same image). It prints the median
time to first token of each, their ratio, the prompt tokens found in the cache, and how many
greedy answers differ between the two (a cached prefix may change them at float-rounding
level; docs/engine.md "Prefix caching").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
)
from vlmserve.testing.media import gradient_image
from vlmserve.testing.tiny import build_qwen2_vl

SENTENCE = "Read each identity card with care and answer only with the field asked for. "


def conversation(i: int, words: int, image: bool) -> GenerateRequest:
    system = SENTENCE * max(1, words // len(SENTENCE.split()))
    messages = [ChatMessage("system", [TextPart(system)])]
    if image:
        card = ImagePart(gradient_image(224, 224, seed=7))
        messages += [
            ChatMessage("user", [card, TextPart("Read the card.")]),
            ChatMessage("assistant", [TextPart("It is an identity card.")]),
        ]
    messages.append(ChatMessage("user", [TextPart(f"Question {i}: which field is number {i}?")]))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return GenerateRequest(f"q{i}", messages, params)


async def one(backend: HFChatBackend, req: GenerateRequest) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens)."""
    started, first, tokens = time.perf_counter(), None, []
    prepared = await backend.prepare(req)
    async for chunk in backend.generate(prepared):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        tokens += chunk.token_ids
    return first or 0.0, tokens


async def run(ns: argparse.Namespace, console: Console) -> None:
    ckpt = build_qwen2_vl(SIZES[ns.size]())
    options = LoadOptions(source=str(ckpt), device="cpu", dtype=ns.dtype)
    engines = {
        name: HFChatBackend(
            name, options, max_model_len=8192, max_num_seqs=8, prefix_caching=(name == "cached")
        )
        for name in ("whole", "cached")
    }
    for backend in engines.values():
        backend.load()
    requests = [conversation(i, ns.system_words, ns.image) for i in range(ns.requests)]
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    answers: dict[str, list[list[int]]] = {name: [] for name in engines}
    for rnd in range(ns.rounds):
        order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
        for name in order:
            for req in requests:
                seconds, tokens = await one(engines[name], req)
                ttft[name].append(seconds)
                if rnd == 0:
                    answers[name].append(tokens)
            p50 = 1000 * statistics.median(ttft[name][-ns.requests :])
            console.print(f"round {rnd + 1}/{ns.rounds} {name:6} TTFT p50 {p50:8.1f} ms")
    scheduler = engines["cached"].engine.scheduler  # type: ignore[union-attr]
    console.print(table(ttft, scheduler.prefix_queried, scheduler.prefix_hits, answers, ns))
    for backend in engines.values():
        backend.close()


def table(
    ttft: dict[str, list[float]],
    queried: int,
    hits: int,
    answers: dict[str, list[list[int]]],
    ns: argparse.Namespace,
) -> Table:
    whole, cached = (statistics.median(ttft[k]) for k in ("whole", "cached"))
    differ = sum(a != b for a, b in zip(answers["whole"], answers["cached"], strict=True))
    t = Table(title=f"prefix caching, {ns.size} checkpoint, {ns.dtype}, c=1")
    for column in ("TTFT p50 whole", "TTFT p50 cached", "ratio", "cached tokens", "answers differ"):
        t.add_column(column, justify="right")
    t.add_row(
        f"{1000 * whole:.1f} ms",
        f"{1000 * cached:.1f} ms",
        f"{whole / cached:.2f}x",
        f"{hits:,} of {queried:,}",
        f"{differ} of {len(answers['whole'])}",
    )
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--system-words", type=int, default=600, help="system prompt length")
    p.add_argument("--requests", type=int, default=8, help="requests per round and engine")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--image", action="store_true", help="a follow-up turn about one image")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Any:
    asyncio.run(run(parse_args(argv), Console()))


if __name__ == "__main__":
    main()
