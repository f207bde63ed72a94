"""Prefill-only forwards: packed prompt rows through the runner's layers to each row's final
hidden state at its last token, with no KV cache at all.

What a scorer needs (a reranker reads one hidden state per query-document pair and never
decodes): the rows run exactly as ``DecoderRunner.step`` runs prefill rows — packed without
padding, the same fused weights, rotary tables, per-layer masks and DeepStack features, each
row attending causally over exactly its own keys — but their K/V are used inside the layer
and dropped, so no cache needs to be allocated and none is written or read. Only the last
tokens' states are read, so the final layer computes attention and MLP for those alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.models.batch import PrefillInputs, PrefillRow
from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["last_hidden"]


def last_hidden(runner: DecoderRunner, rows: list[PrefillRow]) -> torch.Tensor:
    """[n, hidden]: each row's final-norm hidden state at its last token (call it under
    ``torch.inference_mode``). Rows must be whole prompts (no cached prefix)."""
    p = _inputs(runner, rows)
    x = p.x
    final = len(runner.layers) - 1
    for li, layer in enumerate(runner.layers):
        q, k, v = runner._qkv(x, layer, *p.ropes[layer.kind])
        deep = p.deep is not None and li < p.deep.shape[0]
        if li == final and not deep:  # only the last tokens' outputs are read from here on
            return runner._norm(
                runner._mlp(x[p.last], _last_attend(runner, layer, q, k, v, p), layer), runner.norm
            )
        x = runner._mlp(x, runner._prefill_attend(li, layer, q, k, v, p), layer)
        if deep:  # as Qwen3VLTextModel's DeepStack
            x[p.visual] = x[p.visual] + p.deep[li]  # type: ignore[index]
    return runner._norm(x[p.last], runner.norm)


def _last_attend(
    runner: DecoderRunner,
    layer: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: PrefillInputs,
) -> torch.Tensor:
    """The final layer's attention for each row's last token only, over the row's keys
    (its last line of the row's mask, if the layer kind has one) -> [n, H * D]. The other
    tokens' outputs of that layer are never read, so their attention and MLP are skipped."""
    outs = []
    for start, t, row_masks in zip(p.starts, p.lengths, p.masks, strict=True):
        mask = row_masks.get(layer.kind)  # None: causal, and the last query sees every key
        keys = slice(start, start + t)
        o = F.scaled_dot_product_attention(
            q[start + t - 1 : start + t].transpose(0, 1)[None],
            k[keys].transpose(0, 1)[None],
            v[keys].transpose(0, 1)[None],
            attn_mask=None if mask is None else mask[-1:],
            scale=runner.scale,
            enable_gqa=True,
        )  # [1, H, 1, D]
        outs.append(o[0].transpose(0, 1).reshape(1, -1))
    return torch.cat(outs)


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
        [0] * len(rows),  # nothing before any row
        [runner._prefill_masks(row) for row in rows],
        visual,
        deep,
        last,
    )
