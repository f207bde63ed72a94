"""A prompt's prefill alone, against its matmul cost: the same tokens through the linears.

    python benchmarks/prefill.py                          # medium checkpoint, bf16, 1 x 2048, CPU
    python benchmarks/prefill.py --context 2048 --prefix 2048     # a chunk after a cached prefix
    python benchmarks/prefill.py --attention torch        # torch's SDPA instead of the kernel
    python benchmarks/prefill.py --device cuda --batch 8 --context 4096

Builds the engine's decoder runner over a checkpoint (default: ``vlmserve.testing``'s medium
Qwen2-VL) and times ``runner.prefill`` of ``--batch`` rows of ``--context`` new tokens each
(random embeddings at text positions), the best of ``--repeat`` after one untimed pass. With
``--prefix P`` each row has P tokens' keys and values in the paged cache already (random,
written through the cache) and computes only the tokens after them: a later chunk of a
chunked prefill, or a prompt after a prefix-cache hit.

The matmul cost is what the issue's "long prefill at its matmul cost" is measured against:
the same rows through every layer's linears alone (fused q/k/v, o, gate/up and down, the
runner's own ``Linear`` objects), timed in the same run. What is left of the prefill is
attention, norms, rotary embedding, the cache writes and the final norm and head.
``--attention`` picks prefill attention: ``auto`` (what the engine runs: the bf16 kernel on
CPUs with AVX512-BF16, torch's elsewhere) or ``torch`` (``scaled_dot_product_attention``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import sync
from runner import fill, load, model_args, tables_for

__all__ = ["Result", "main", "parse_args"]


@dataclass(slots=True)
class Result:
    checkpoint: str
    attention: str  # what prefill attention ran on
    device: str
    dtype: str
    threads: int
    batch: int
    context: int  # new tokens a row
    prefix: int  # cached tokens before them
    ms: float  # best prefill
    tokens_per_s: float
    linears_ms: float  # best pass of the same rows through the linears alone
    ratio: float  # ms / linears_ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/prefill.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(p)
    p.add_argument("--batch", type=int, default=1, help="rows prefilled together")
    p.add_argument("--context", type=int, default=2048, help="new tokens in each row")
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before them")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--repeat", type=int, default=3, help="timed passes (the best is reported)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--attention", choices=["auto", "torch"], default="auto")
    p.add_argument("--json", type=Path, help="also write the result here")
    ns = p.parse_args(argv)
    for flag in ("batch", "context", "block_size", "repeat"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if ns.prefix < 0:
        p.error("--prefix must be at least 0")
    return ns


def rows_for(runner: Any, ns: argparse.Namespace, tables: list[list[int]]) -> list[Any]:
    """Each row's ``PrefillRow``: random embeddings of its new tokens, their cache slots, and
    (after a prefix) its block table."""
    from vlmserve.engine.models.batch import PrefillRow

    gen = torch.Generator().manual_seed(1)
    bs, rows = ns.block_size, []
    for table in tables:
        pos = range(ns.prefix, ns.prefix + ns.context)
        embeds = torch.randn(ns.context, runner.hidden, generator=gen).mul_(0.5)
        row = PrefillRow(
            embeds=embeds.to(runner.device, runner.dtype),
            positions=torch.arange(ns.prefix, ns.prefix + ns.context).expand(3, -1),
            slots=[table[i // bs] * bs + i % bs for i in pos],
        )
        if ns.prefix:
            row.cached, row.table = ns.prefix, table
        rows.append(row)
    return rows


def linears_only(runner: Any, tokens: int) -> None:
    """The prefill's linears on ``tokens`` rows, layer by layer (inputs of the right widths)."""
    x = torch.randn(tokens, runner.hidden, device=runner.device).to(runner.dtype)
    attn = torch.randn(tokens, runner.heads * runner.head_dim, device=runner.device)
    attn = attn.to(runner.dtype)
    for layer in runner.layers:
        layer.qkv(x)
        x = layer.o(attn)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        x = layer.down(gate * up)


def best_of(repeat: int, device: torch.device, work: Any) -> float:
    work()  # untimed
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        started = time.perf_counter()
        work()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def run(ns: argparse.Namespace) -> Result:
    from vlmserve.engine.models.runner import Qwen2VLRunner

    ckpt, model, device, dtype = load(ns)
    positions = model.config.get_text_config().max_position_embeddings
    if ns.prefix + ns.context > positions:
        raise SystemExit(
            f"--prefix + --context = {ns.prefix + ns.context}: the checkpoint has {positions} "
            "positions"
        )
    runner = Qwen2VLRunner(model)
    tables = tables_for(ns.batch, ns.prefix + ns.context, ns.block_size)
    runner.allocate_cache(1 + sum(len(t) for t in tables), ns.block_size)
    attention = "torch scaled_dot_product_attention"
    if ns.attention == "auto" and device.type == "cpu":
        how = runner.use_compiled_attention()
        kernel = runner.compiled is not None and runner.compiled.prefills
        attention = "bf16 prefill kernel" if kernel and dtype == torch.bfloat16 else attention
        print(how)
    with torch.inference_mode():
        if ns.prefix:
            fill(runner, tables, ns.prefix)
        rows = rows_for(runner, ns, tables)
        ms = best_of(ns.repeat, device, lambda: runner.prefill(rows))
        linears = best_of(ns.repeat, device, lambda: linears_only(runner, ns.batch * ns.context))
    return Result(
        checkpoint=str(ckpt),
        attention=attention,
        device=str(device),
        dtype=ns.dtype,
        threads=torch.get_num_threads(),
        batch=ns.batch,
        context=ns.context,
        prefix=ns.prefix,
        ms=ms,
        tokens_per_s=ns.batch * ns.context / ms * 1e3,
        linears_ms=linears,
        ratio=ms / linears,
    )


def main(argv: list[str] | None = None) -> Result:
    ns = parse_args(argv)
    r = run(ns)
    after = f" after {r.prefix} cached" if r.prefix else ""
    print(
        f"{r.batch} rows x {r.context} tokens{after}, {r.dtype} on {r.device} "
        f"({r.threads} threads, {r.attention}): {r.ms:.1f} ms "
        f"(best of {ns.repeat}; {r.tokens_per_s:.0f} tokens/s)\n"
        f"linears alone {r.linears_ms:.1f} ms; prefill {r.ratio:.2f}x its matmul cost"
    )
    if ns.json:
        ns.json.write_text(json.dumps(asdict(r), indent=2) + "\n")
        print(f"wrote {ns.json}")
    return r


if __name__ == "__main__":
    main()
