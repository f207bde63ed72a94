"""Prefill-only forwards: packed prompt rows through the runner's layers to each row's final
hidden state at its last token, with no KV cache at all.

What a scorer needs (a reranker reads one hidden state per query-document pair and never
decodes): the rows run exactly as ``DecoderRunner.step`` runs prefill rows — packed without
padding, the same fused weights, rotary tables, per-layer masks and DeepStack features, each
row attending causally over exactly its own keys — but their K/V are used inside the layer
and dropped, so no cache needs to be allocated and none is written or read. Only the last
tokens' states are read, so the final layer computes attention and MLP for those alone.

Rows that begin alike share that beginning's forward: a reranker's pairs of one query under
an instruction-and-query-first template (Qwen3-VL-Reranker's: system prompt, instruction,
query, then the document) repeat all of that in every row. Where every row's
first ``P`` embeddings and positions are equal (no family mask, and DeepStack features only
after them), those ``P`` tokens run once as a row of their own and each row runs only its
remaining tokens, attending over the shared keys and then its own, as a prompt after a
cached prefix does. A token's state depends only on the tokens before it, so each row's
result is the one it would have alone, up to the order of floating-point sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.models.batch import PrefillInputs, PrefillRow
from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["SHARED_MIN", "last_hidden", "shared_prefix"]


SHARED_MIN = 16  # shorter common beginnings are not worth a row of their own


def last_hidden(runner: DecoderRunner, rows: list[PrefillRow]) -> torch.Tensor:
    """[n, hidden]: each row's final-norm hidden state at its last token (call it under
    ``torch.inference_mode``). Rows must be whole prompts (no cached prefix)."""
    shared = shared_prefix(runner, rows)
    if shared:
        return _last_hidden_shared(runner, rows, shared)
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


def shared_prefix(runner: DecoderRunner, rows: list[PrefillRow]) -> int:
    """How many leading tokens every row has alike (equal embeddings and positions), where
    sharing them applies: two rows or more, none with a family mask, at least ``SHARED_MIN``
    tokens, none of them a token DeepStack features are added to, and each row keeping one
    token of its own. 0 otherwise."""
    if len(rows) < 2 or any(row.cached for row in rows):
        return 0
    if any(runner._prefill_masks(row) for row in rows):
        return 0
    first = rows[0]
    shared = min(row.embeds.shape[0] for row in rows) - 1
    for row in rows:
        if row.deepstack is not None and row.visual is not None and row.visual.numel():
            shared = min(shared, int(row.visual.min()))
    for row in rows[1:]:
        if shared < SHARED_MIN:
            return 0
        differs = (row.embeds[:shared] != first.embeds[:shared]).any(dim=1)
        if first.positions is not None or row.positions is not None:
            mine, theirs = _positions(first, 0, shared), _positions(row, 0, shared)
            differs |= (mine != theirs).any(dim=0)
        hits = differs.nonzero()
        if hits.numel():
            shared = int(hits[0, 0])
    return shared if shared >= SHARED_MIN else 0


def _positions(row: PrefillRow, start: int, end: int) -> torch.Tensor:
    """[3, end - start]: the row's M-RoPE positions of tokens start..end-1."""
    if row.positions is None:
        return torch.arange(start, end, device=row.embeds.device).expand(3, end - start)
    return row.positions[:, start:end]


def _last_hidden_shared(runner: DecoderRunner, rows: list[PrefillRow], shared: int) -> torch.Tensor:
    """``last_hidden`` with the rows' first ``shared`` tokens run once: packed as a row of
    their own (first), then each row's remaining tokens, which attend over those keys and
    then their own."""
    head = PrefillRow(rows[0].embeds[:shared], _positions(rows[0], 0, shared))
    tails = [
        PrefillRow(
            row.embeds[shared:],
            _positions(row, shared, row.embeds.shape[0]),
            visual=None if row.visual is None else row.visual - shared,
            deepstack=row.deepstack,
        )
        for row in rows
    ]
    p = _inputs(runner, [head, *tails])
    last = p.last[1:]  # the tails' last tokens
    x = p.x
    final = len(runner.layers) - 1
    for li, layer in enumerate(runner.layers):
        q, k, v = runner._qkv(x, layer, *p.ropes[layer.kind])
        deep = p.deep is not None and li < p.deep.shape[0]
        if li == final and not deep:
            attn = _tails_attend(runner, q, k, v, p, last_only=True)
            return runner._norm(runner._mlp(x[last], attn, layer), runner.norm)
        head_attn = _attend(runner, q[:shared], k[:shared], v[:shared], 0)
        attn = torch.cat([head_attn, _tails_attend(runner, q, k, v, p, last_only=False)])
        x = runner._mlp(x, attn, layer)
        if deep:  # as Qwen3VLTextModel's DeepStack
            x[p.visual] = x[p.visual] + p.deep[li]  # type: ignore[index]
    return runner._norm(x[last], runner.norm)


def _tails_attend(
    runner: DecoderRunner,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: PrefillInputs,
    *,
    last_only: bool,
) -> torch.Tensor:
    """Each tail row's attention over the shared keys and then its own -> [rows' tokens (or
    one a row), H * D]."""
    shared = p.lengths[0]
    outs = []
    for start, t in zip(p.starts[1:], p.lengths[1:], strict=True):
        keys = torch.cat([k[:shared], k[start : start + t]])
        values = torch.cat([v[:shared], v[start : start + t]])
        if last_only:
            outs.append(_attend(runner, q[start + t - 1 : start + t], keys, values, shared + t - 1))
        else:
            outs.append(_attend(runner, q[start : start + t], keys, values, shared))
    return torch.cat(outs)


def _attend(
    runner: DecoderRunner, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int
) -> torch.Tensor:
    """Causal attention of q [t, H, D], the tokens at positions first..first+t-1, over keys
    and values [first + t, KVH, D] from position 0 -> [t, H * D]."""
    t = q.shape[0]
    if runner.compiled is not None:  # bfloat16 on AVX512-BF16
        o = runner.compiled.prefill(q, k, v, runner.scale, first)
        if o is not None:
            return o.view(t, -1)
    mask = None if first == 0 else runner._causal(first, t, first + t)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).contiguous()[None],
        k.transpose(0, 1).contiguous()[None],
        v.transpose(0, 1).contiguous()[None],
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None,
        scale=runner.scale,
        enable_gqa=True,
    )  # [1, H, t, D]
    return o[0].transpose(0, 1).reshape(t, -1)
