"""What one forward of the decoder runner computes: prefill rows (whole prompts or chunks of
them) and decode rows (one token each), as the engine hands them over (``PrefillRow``,
``DecodeRows``) and as the runner lays them out on the device for a step
(``PrefillInputs``, ``DecodeInputs``: packed tokens, cache slots, rotary tables, masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlmserve.engine.models.runner import DecoderRunner

__all__ = [
    "DecodeInputs",
    "DecodeRows",
    "PrefillInputs",
    "PrefillRow",
    "decode_inputs",
    "prefill_inputs",
]


@dataclass(slots=True)
class PrefillRow:
    """A prompt (or a chunk of one) with its vision features in, as the embedder built it."""

    embeds: torch.Tensor  # [T, hidden]: token embeddings, vision features scattered in
    positions: torch.Tensor | None  # [3, T] M-RoPE positions; None: text only (0..T-1)
    slots: list[int] = field(default_factory=list)  # [T] cache slot of each token
    visual: torch.Tensor | None = None  # [M] indices of the visual tokens (DeepStack only)
    deepstack: torch.Tensor | None = None  # [layers k, M, hidden]: added after layers 0..k-1
    # image block of each token, -1 text (Gemma 3); after a cached prefix, of every token
    # from the prompt's start to the end of ``embeds`` (the keys): [cached + T]
    blocks: torch.Tensor | None = None
    cached: int = 0  # prompt tokens before ``embeds`` whose K/V are in the cache already
    table: list[int] | None = None  # the row's block table (when ``cached``)


@dataclass(slots=True)
class DecodeRows:
    """Rows that decode one token this step (``DecoderRunner.decode``'s arguments)."""

    tokens: list[int]  # the token each row feeds
    positions: list[int]  # its rotary position
    lengths: list[int]  # tokens the row has before it: the new one is written there
    tables: list[list[int]]  # the row's block table (room for the new token made)


@dataclass(slots=True)
class DecodeInputs:
    """Decode rows on the device: their embeddings, slots, rotary tables and attention."""

    x: torch.Tensor  # [B, hidden]
    slots: torch.Tensor  # [B]
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]
    count: int
    table: torch.Tensor  # [B, MB] block tables, padded with the null block
    lengths: torch.Tensor  # [B]
    masks: dict[str, torch.Tensor] | None  # gathered attention's [B, 1, 1, L] masks by kind
    attend: torch.Tensor | None = None  # the CPU kernel's keys a row (lengths + 1), checked


@dataclass(slots=True)
class PrefillInputs:
    """Prefill rows on the device, packed without padding; attention runs per row."""

    x: torch.Tensor  # [N, hidden]: the rows' embeddings packed
    slots: torch.Tensor  # [N]
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]
    starts: list[int]
    lengths: list[int]
    tables: list[torch.Tensor | None]  # [1, MB] for a row after a cached prefix
    cached: list[int]  # each row's tokens before its own (a cached prefix, earlier chunks)
    masks: list[dict[str, torch.Tensor]]
    visual: torch.Tensor | None  # [M] packed indices of DeepStack's visual tokens
    deep: torch.Tensor | None  # [k, M, hidden]
    last: torch.Tensor  # [n] each row's last token


def prefill_inputs(runner: DecoderRunner, rows: list[PrefillRow]) -> PrefillInputs:
    """``rows`` laid out for one forward: packed, with their slots, rotary tables and masks."""
    cache = runner._kv()
    lengths = [row.embeds.shape[0] for row in rows]
    (slots,) = runner._host([s for row in rows for s in row.slots])  # [N]
    starts = [sum(lengths[:i]) for i in range(len(rows))]
    visual, deep = runner._deepstack(rows, starts)
    tables = [  # rows after a cached prefix attend to their blocks: [1, MB] each
        torch.tensor([row.table], device=runner.device) if row.cached and row.table else None
        for row in rows
    ]
    masks = [  # by layer kind: [T, T], or [T, L] after a cached prefix (L: the gathered
        # keys); a kind without one is plain causal
        runner._prefill_masks(row)
        if table is None
        else runner._cached_masks(row, table.shape[1] * cache.block_size)
        for row, table in zip(rows, tables, strict=True)
    ]
    last = torch.tensor(
        [s + t - 1 for s, t in zip(starts, lengths, strict=True)], device=runner.device
    )
    return PrefillInputs(
        torch.cat([row.embeds for row in rows]),  # [N, hidden], rows packed
        slots,
        runner._prefill_rope(rows),
        starts,
        lengths,
        tables,
        [row.cached if table is not None else 0 for row, table in zip(rows, tables, strict=True)],
        masks,
        visual,
        deep,
        last,
    )


def decode_inputs(runner: DecoderRunner, rows: DecodeRows) -> DecodeInputs:
    """``rows`` on the device: their embeddings, cache slots, block tables and masks."""
    cache = runner._kv()
    bs = cache.block_size
    width = max(len(t) for t in rows.tables)
    slots = [t[n // bs] * bs + n % bs for t, n in zip(rows.tables, rows.lengths, strict=True)]
    ids, pos, slot_t, len_t = runner._host(rows.tokens, rows.positions, slots, rows.lengths)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in rows.tables])  # [B, MB]
    table_t = table_t.to(runner.device)
    highest = max(rows.positions)
    ropes = {kind: t.text(pos, highest) for kind, t in runner.ropes.items()}
    masks = attend = None
    if runner.compiled is None:
        masks = runner._decode_masks(len_t, width * bs)
    else:  # the kernel's range check, once a step instead of once a layer
        attend = (len_t + 1).contiguous()
        runner.compiled.check(table_t, attend, cache.num_blocks, bs)
    x = runner.embed(ids)
    return DecodeInputs(x, slot_t, ropes, len(rows.tokens), table_t, len_t, masks, attend)
