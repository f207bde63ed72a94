"""Prefill-only forwards: packed prompt rows through the runner's layers to each row's final
hidden state at its last token, with no KV cache at all.

What a scorer needs (a reranker reads one hidden state per query-document pair and never
decodes): the rows run exactly as ``DecoderRunner.step`` runs prefill rows — packed without
padding, the same fused weights, rotary tables, per-layer masks and DeepStack features, each
row attending causally over exactly its own keys — but their K/V are used inside the layer
and dropped, so no cache needs to be allocated and none is written or read.
"""

from __future__ import annotations

import torch

from vlmserve.engine.models.batch import PrefillInputs, PrefillRow
from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["last_hidden"]


def last_hidden(runner: DecoderRunner, rows: list[PrefillRow]) -> torch.Tensor:
    """[n, hidden]: each row's final-norm hidden state at its last token (call it under
    ``torch.inference_mode``). Rows must be whole prompts (no cached prefix)."""
    p = _inputs(runner, rows)
    x = p.x
    for li, layer in enumerate(runner.layers):
        q, k, v = runner._qkv(x, layer, *p.ropes[layer.kind])
        x = runner._mlp(x, runner._prefill_attend(li, layer, q, k, v, p), layer)
        if p.deep is not None and li < p.deep.shape[0]:  # as Qwen3VLTextModel's DeepStack
            x[p.visual] = x[p.visual] + p.deep[li]
    return runner._norm(x[p.last], runner.norm)


def _inputs(runner: DecoderRunner, rows: list[PrefillRow]) -> PrefillInputs:
    """The rows laid out as ``DecoderRunner.step`` lays out prefill rows, without cache
    slots or block tables (every row attends over its own keys only)."""
    if not rows:
        raise ValueError("no rows to run")
    if any(row.cached for row in rows):
        raise ValueError("a prefill-only row cannot start after a cached prefix")
    lengths = [row.embeds.shape[0] for row in rows]
    starts = [sum(lengths[:i]) for i in range(len(rows))]
    visual, deep = runner._deepstack(rows, starts)
    last = torch.tensor(
        [s + t - 1 for s, t in zip(starts, lengths, strict=True)], device=runner.device
    )
    return PrefillInputs(
        torch.cat([row.embeds for row in rows]),  # [N, hidden], rows packed
        torch.empty(0, dtype=torch.long, device=runner.device),  # no cache slots
        runner._prefill_rope(rows),
        starts,
        lengths,
        [None] * len(rows),  # no block tables: _prefill_attend never reads the cache
        [runner._prefill_masks(row) for row in rows],
        visual,
        deep,
        last,
    )
