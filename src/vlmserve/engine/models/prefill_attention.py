"""Prefill attention: each row over exactly its own keys, on the CPU's bf16 kernel where it
applies (``cpu_prefill.c`` through ``DecoderRunner.compiled``), torch's
``scaled_dot_product_attention`` otherwise.

A row prefilled whole attends causally (or with its family's masks) over its own packed
keys; a row after a cached prefix or earlier chunks attends over its blocks, gathered from
the paged cache, its queries at positions ``first..``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vlmserve.engine.models.batch import PrefillInputs
    from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["prefill_attention"]


def prefill_attention(
    runner: DecoderRunner,
    li: int,
    kind: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: PrefillInputs,
) -> torch.Tensor:
    """Layer ``li`` (of rotary/mask ``kind``): each prefill row's attention -> [N, H * D]."""
    outs = []
    rows = zip(p.starts, p.lengths, p.masks, p.tables, p.cached, strict=True)
    for start, t, row_masks, table, first in rows:
        mask = row_masks.get(kind)  # None: plain causal
        if table is not None:
            outs.append(_after_prefix(runner, li, q[start : start + t], table, mask, first))
            continue
        own = slice(start, start + t)
        if mask is None and runner.compiled is not None:  # bfloat16 on AVX512-BF16
            o = runner.compiled.prefill(q[own], k[own], v[own], runner.scale)
            if o is not None:
                outs.append(o.view(t, -1))
                continue
        o = F.scaled_dot_product_attention(  # contiguous heads: faster than strided views
            q[own].transpose(0, 1).contiguous()[None],
            k[own].transpose(0, 1).contiguous()[None],
            v[own].transpose(0, 1).contiguous()[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=runner.scale,
            enable_gqa=True,
        )  # [1, H, T, D]: each row over exactly its own keys
        outs.append(o[0].transpose(0, 1).reshape(t, -1))
    return torch.cat(outs)


def _after_prefix(
    runner: DecoderRunner,
    li: int,
    q: torch.Tensor,
    table: torch.Tensor,
    seen: torch.Tensor | None,
    first: int,
) -> torch.Tensor:
    """Attention of a row that computes only its tokens after the ``first`` before them (a
    cached prefix, earlier chunks): q [t, H, D] (their K/V written already) over the row's
    blocks (table [1, MB]) with ``seen`` [t, L] (``_cached_masks``; None: plain causal) ->
    [t, H * D]."""
    keys, values = runner._kv().gather(li, table)  # [1, KVH, L, D]
    t = q.shape[0]
    if seen is None and runner.compiled is not None:  # bfloat16 on AVX512-BF16
        o = runner.compiled.prefill(
            q, keys[0].transpose(0, 1), values[0].transpose(0, 1), runner.scale, first
        )
        if o is not None:
            return o.view(t, -1)
    if seen is None:
        seen = runner._causal(first, t, keys.shape[2])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys,
        values,
        attn_mask=seen[None, None],
        scale=runner.scale,
        enable_gqa=True,
    )  # [1, H, t, D]
    return o[0].transpose(0, 1).reshape(t, -1)
