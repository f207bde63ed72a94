"""The decode step alone, against the floor from the bytes it must read.

    python benchmarks/runner.py                          # medium checkpoint, bf16, 8 x 4096, CPU
    python benchmarks/runner.py --device cuda --batch 64 --context 1024
    python benchmarks/runner.py --size tiny --dtype float32 --batch 2 --context 64 --steps 3

Builds the engine's decoder runner over a checkpoint (default: ``vlmserve.testing``'s medium
Qwen2-VL), a paged KV cache holding ``--batch`` rows of ``--context`` tokens each (random keys
and values written through the cache, no prefill), and times one decode step of all rows:
the median of ``--steps`` steps after ``--warmup`` untimed ones. The floor is the bytes a step
must read -- every language-model weight once (not the vision tower; a tied embedding / LM
head once) plus each row's keys and values of its context and new token in every layer --
divided by the copy bandwidth measured in the same run: a ``--copy-mib`` tensor copy (1 GiB
by default; read + written bytes / time) on the same device with the same threads. Printed:
ms per step, the floor in ms, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import copy_bandwidth, decode_weight_bytes, kv_bytes_per_token, sync

__all__ = ["Result", "fill", "load", "main", "model_args", "parse_args", "tables_for"]


@dataclass(slots=True)
class Result:
    checkpoint: str
    mode: str  # gathered | compiled | eager | graphs
    device: str
    dtype: str
    threads: int
    batch: int
    context: int
    block_size: int
    steps: int
    ms_per_step: float  # median
    ms_per_step_min: float
    weight_bytes: int  # read per step: the language model's weights
    kv_bytes: int  # read per step: every row's keys and values (context + the new token)
    copy_bandwidth_gb_s: float
    floor_ms: float
    ratio: float  # ms_per_step / floor_ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/runner.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(p)
    p.add_argument("--batch", type=int, default=8, help="rows decoded per step")
    p.add_argument("--context", type=int, default=4096, help="tokens in each row's cache")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB copied to measure bandwidth")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument(
        "--mode",
        choices=["auto", "gathered", "compiled", "eager", "graphs"],
        default="auto",
        help="decode attention: gathered blocks (the fallback), paged in place compiled for "
        "CPU (CPU's path), paged in place on CUDA eagerly or as CUDA graphs; auto: what the "
        "engine uses on the device",
    )
    ns = p.parse_args(argv)
    for flag in ("batch", "context", "block_size", "steps", "copy_mib"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if ns.warmup < 0:
        p.error("--warmup must be at least 0")
    return ns


def model_args(p: argparse.ArgumentParser) -> None:
    """The flags that pick the checkpoint, its dtype and device (``load``)."""
    p.add_argument("--model", help="checkpoint dir (default: the --size test checkpoint)")
    p.add_argument("--size", choices=["medium", "tiny"], default="medium")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")


def tables_for(batch: int, context: int, block_size: int) -> list[list[int]]:
    """Each row's block table: room for ``context`` tokens and the one a step writes; blocks
    1.. in order (0 is the cache's null block), no block shared."""
    per_row = (context + 1 + block_size - 1) // block_size
    return [list(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(batch)]


def checkpoint(ns: argparse.Namespace) -> Path:
    if ns.model:
        return Path(ns.model)
    from vlmserve.testing import build_medium, build_qwen2_vl

    return build_medium() if ns.size == "medium" else build_qwen2_vl()


def fill(runner: Any, tables: list[list[int]], context: int) -> None:
    """Write random keys and values for tokens 0..context-1 of every row, in every layer."""
    cache = runner.cache
    gen = torch.Generator().manual_seed(0)
    shape = (context, cache.kv_heads, cache.head_dim)
    for table in tables:
        pos = torch.arange(context)
        slots = (
            torch.tensor(table)[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        ).to(runner.device)
        for layer in range(cache.layers):
            k, v = (torch.randn(shape, generator=gen).mul_(0.5) for _ in range(2))
            cache.write(
                layer, slots, k.to(runner.device, runner.dtype), v.to(runner.device, runner.dtype)
            )


def load(ns: argparse.Namespace) -> tuple[Path, Any, torch.device, torch.dtype]:
    """``--threads`` applied; the checkpoint, its model loaded on ``--device`` in ``--dtype``."""
    from transformers import AutoModelForImageTextToText

    if ns.threads:
        torch.set_num_threads(ns.threads)
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    ckpt = checkpoint(ns)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    return ckpt, model, device, dtype


def run(ns: argparse.Namespace) -> Result:
    from vlmserve.engine.models.cpu_kernels import settle_linears
    from vlmserve.engine.models.runner import Qwen2VLRunner

    ckpt, model, device, dtype = load(ns)
    positions = model.config.get_text_config().max_position_embeddings
    if ns.context + 1 > positions:
        raise SystemExit(f"--context {ns.context}: the checkpoint has {positions} positions")
    _, weights = decode_weight_bytes(model)
    kv = ns.batch * (ns.context + 1) * kv_bytes_per_token(model.config, dtype.itemsize)
    runner = Qwen2VLRunner(model)
    tables = tables_for(ns.batch, ns.context, ns.block_size)
    runner.allocate_cache(1 + sum(len(t) for t in tables), ns.block_size)
    mode = ns.mode
    if mode == "auto":
        mode = "graphs" if device.type == "cuda" else "compiled"
    if mode == "compiled":
        started = time.perf_counter()
        how = runner.use_compiled_attention()
        print(f"{how}; {time.perf_counter() - started:.1f} s to set up")
        if runner.compiled is None:
            raise SystemExit(f"--mode compiled is not available here: decode runs with {how}")
    elif mode != "gathered":
        how = runner.use_paged_decode(ns.batch, graphs=mode == "graphs")
        if not how.startswith("paged") or (mode == "graphs") != ("CUDA graphs" in how):
            raise SystemExit(f"--mode {mode} is not available here: decode runs with {how}")
    settle_linears(runner, runner.compiled)  # as the engine: pack what no kernel took
    with torch.inference_mode():
        fill(runner, tables, ns.context)
        tokens = torch.randint(0, model.config.get_text_config().vocab_size, (ns.batch,))
        step = {
            "tokens": tokens.tolist(),
            "positions": [ns.context] * ns.batch,
            "lengths": [ns.context] * ns.batch,
            "tables": tables,
        }
        for _ in range(ns.warmup):
            runner.decode(**step)
        times = []
        for _ in range(ns.steps):
            sync(device)
            started = time.perf_counter()
            runner.decode(**step)
            sync(device)
            times.append((time.perf_counter() - started) * 1e3)
    del runner, model
    bandwidth = copy_bandwidth(device, ns.copy_mib)
    floor = (weights + kv) / bandwidth * 1e3
    ms = statistics.median(times)
    return Result(
        checkpoint=str(ckpt),
        mode=mode,
        device=str(device),
        dtype=ns.dtype,
        threads=torch.get_num_threads(),
        batch=ns.batch,
        context=ns.context,
        block_size=ns.block_size,
        steps=ns.steps,
        ms_per_step=ms,
        ms_per_step_min=min(times),
        weight_bytes=weights,
        kv_bytes=kv,
        copy_bandwidth_gb_s=bandwidth / 1e9,
        floor_ms=floor,
        ratio=ms / floor,
    )


def main(argv: list[str] | None = None) -> Result:
    ns = parse_args(argv)
    r = run(ns)
    print(
        f"{r.batch} rows x {r.context} tokens, {r.dtype} on {r.device} "
        f"({r.threads} threads, {r.mode}): "
        f"{r.ms_per_step:.2f} ms/step (median of {r.steps}; min {r.ms_per_step_min:.2f})\n"
        f"floor {r.floor_ms:.2f} ms = ({r.weight_bytes / 1e6:.1f} MB weights + "
        f"{r.kv_bytes / 1e6:.1f} MB KV) / {r.copy_bandwidth_gb_s:.1f} GB/s copy bandwidth\n"
        f"ratio {r.ratio:.2f}x the floor"
    )
    if ns.json:
        ns.json.write_text(json.dumps(asdict(r), indent=2) + "\n")
        print(f"wrote {ns.json}")
    return r


if __name__ == "__main__":
    main()
