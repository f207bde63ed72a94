"""Checks of the paged decode path run in a subprocess with ``TRITON_INTERPRET=1`` (Triton's
CPU interpreter reads the variable when the kernels are defined, so it must be set before
``vlmserve.engine.models.paged_attention`` is imported). Prints one JSON object.

    TRITON_INTERPRET=1 python tests/unit/engine/models/paged_check.py kernel|runner TINY_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from vlmserve.engine.models import paged_attention as pa


def kernel() -> dict[str, float]:
    """Max |paged - gathered| over rows that end mid-block, on a block boundary, at one key,
    and across several splits, for grouped-query heads (3 query heads per KV head)."""
    torch.manual_seed(0)
    blocks, size, kv_heads, dim, heads = 80, 16, 2, 64, 6
    lengths = [1, 16, 17, 300, 600, 33]
    width = max(-(-n // size) for n in lengths)
    out = {}
    for dtype in (torch.float32, torch.float16):
        k = torch.randn(blocks, size, kv_heads, dim, dtype=dtype)
        v = torch.randn(blocks, size, kv_heads, dim, dtype=dtype)
        order = (torch.randperm(blocks - 1) + 1).tolist()  # any block but the null one
        tables = torch.zeros(len(lengths), width, dtype=torch.int32)
        for row, n in enumerate(lengths):
            need = -(-n // size)
            tables[row, :need] = torch.tensor(order[row * 7 : row * 7 + need])
        q = torch.randn(len(lengths), heads, dim, dtype=dtype)
        lens = torch.tensor(lengths, dtype=torch.int32)
        splits = pa.splits_for(width, size)
        got = pa.paged_decode(q, k, v, tables, lens, dim**-0.5, splits)
        want = pa.reference(q, k, v, tables, lens, dim**-0.5)
        out[str(dtype)] = float((got.float() - want.float()).abs().max())
        out["splits"] = splits[0]
    return out


def runner(tiny_dir: str) -> dict[str, object]:
    """The tiny Qwen2-VL's decode step: gathered attention, then ``PagedDecode`` with the
    batch alone and padded to a larger bucket, on the same cache contents."""
    from transformers import AutoModelForImageTextToText

    from vlmserve.engine.models.architectures import build
    from vlmserve.engine.models.graphs import PagedDecode
    from vlmserve.engine.models.runner import PrefillRow
    from vlmserve.engine.models.vision_cache import VisionCache

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    run, _ = build(model, VisionCache(0))
    size = 16
    run.allocate_cache(64, size)
    prompts = [5, 40, 17]  # tokens already in the cache per row, some across block ends
    tables, start = [], 1
    rows = []
    for n in prompts:
        need = -(-(n + 1) // size)
        table = list(range(start, start + need))
        start += need
        tables.append(table)
        ids = torch.randint(0, 100, (n,))
        slots = [table[i // size] * size + i % size for i in range(n)]
        rows.append(PrefillRow(embeds=run.embed(ids), positions=None, slots=slots))
    run.cache.clear(list(range(1, start)))  # as the engine clears fresh blocks (torch.empty)
    with torch.inference_mode():
        run.prefill(rows)
        tokens, positions = [7, 8, 9], list(prompts)
        gathered = run.decode(tokens, positions, list(prompts), tables)
        paged = PagedDecode(run, 8, graphs=False)
        cache = run.cache

        def no_gather(*args: object, **kwargs: object) -> None:
            raise AssertionError("the paged decode step gathered cache blocks")

        cache.gather = no_gather  # type: ignore[method-assign,union-attr]
        alone = paged.run(tokens, positions, list(prompts), tables)
        paged._fill(tokens, positions, list(prompts), tables, 8)
        padded = paged.step(8)[:3]
    return {
        "alone": float((alone - gathered).abs().max()),
        "padded": float((padded - gathered).abs().max()),
        "argmax_equal": bool(
            torch.equal(alone.argmax(-1), gathered.argmax(-1))
            and torch.equal(padded.argmax(-1), gathered.argmax(-1))
        ),
        "buckets": list(paged.buckets),
    }


if __name__ == "__main__":
    result = kernel() if sys.argv[1] == "kernel" else runner(sys.argv[2])
    print(json.dumps(result))
