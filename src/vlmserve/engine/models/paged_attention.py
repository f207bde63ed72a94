"""Decode attention that reads the paged KV cache where it lies (CUDA, Triton).

One query per row and head attends to the row's keys 0..len-1, read block by block through
its block table straight from the cache (``k, v: [num_blocks, block_size, kv_heads, D]`` of
one layer), in the cache's dtype, with float32 accumulation. Nothing is gathered, cast or
padded per step, so a step reads the bytes it needs (weights + the rows' KV) and its shapes
do not depend on the rows' lengths: a CUDA graph of it (``graphs.py``) replays for any
context.

The work is split as vLLM's paged attention v2 (flash-decoding): program ``(b, kv_head,
split)`` takes ``split``'s share of row ``b``'s blocks for the query heads of one KV head
(grouped-query attention: the ``rep`` query heads that share it, padded to the 16 rows
``tl.dot`` needs) and writes its partial max, sum and weighted values; a second kernel
merges the splits. The number of splits is fixed per cache (``splits_for``), not per step:
splits past a row's length exit at once.

On CPU the runner keeps ``scaled_dot_product_attention`` over gathered blocks (batch
invariant there; see ``runner._decode_attention``). ``reference`` is that computation, for
tests.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with torch's CUDA builds; without it CUDA decode gathers as on CPU
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]

__all__ = ["available", "paged_decode", "reference", "splits_for"]

MAX_SPLITS = 64  # partial results per row and head: bounds the merge's work and memory
MIN_SPLIT_TOKENS = 256  # a split reads at least this many keys (below that, launch costs win)


def available(device: torch.device) -> bool:
    """Whether ``paged_decode`` runs on ``device`` (CUDA with Triton, or Triton's CPU
    interpreter when ``TRITON_INTERPRET=1``, which the tests use)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def splits_for(max_blocks: int, block_size: int) -> tuple[int, int]:
    """(splits, blocks per split) for rows of at most ``max_blocks`` blocks: each split
    reads at least ``MIN_SPLIT_TOKENS`` keys, and there are at most ``MAX_SPLITS``."""
    per = max(1, math.ceil(MIN_SPLIT_TOKENS / block_size))
    per = max(per, math.ceil(max_blocks / MAX_SPLITS))
    return math.ceil(max_blocks / per), per


if triton is not None:

    @triton.jit
    def _partial_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_kblock,
        stride_kslot,
        stride_khead,
        stride_tb,
        splits,
        heads,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        PER_SPLIT: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        first = split * PER_SPLIT
        last = tl.minimum(first + PER_SPLIT, tl.cdiv(length, BLOCK))
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D_PAD)
        head = kvh * REP + r  # [REP_PAD] query heads of this KV head
        row_ok = r < REP
        d_ok = d < D
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [REP_PAD, D_PAD]
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D_PAD], tl.float32)
        slot = tl.arange(0, BLOCK)
        for j in range(first, last):
            block = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            base = block * stride_kblock + kvh * stride_khead
            offs = base + slot[:, None] * stride_kslot + d[None, :]
            k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0)  # [BLOCK, D_PAD]
            v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [REP_PAD, BLOCK] float32
            seen = (j * BLOCK + slot) < length
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            s_sum = s_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # partials: [B, H, splits] for m and the sum, [B, H, splits, D] for the values
        at = (b * heads + head) * splits + split
        tl.store(m_ptr + at, m, mask=row_ok)
        tl.store(l_ptr + at, s_sum, mask=row_ok)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        splits,
        stride_ob,
        stride_oh,
        heads,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D_PAD)
        s_ok = s < splits
        at = (b * heads + h) * splits + s
        m = tl.load(m_ptr + at, mask=s_ok, other=float("-inf"))  # [SPLITS_PAD]
        total = tl.max(m, 0)
        w = tl.where(s_ok & (m > float("-inf")), tl.exp(m - total), 0.0)
        denom = tl.sum(tl.load(l_ptr + at, mask=s_ok, other=0.0) * w, 0)
        acc = tl.load(
            acc_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :], other=0.0
        )  # [SPLITS_PAD, D_PAD]
        o = tl.sum(acc * w[:, None], 0) / denom
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D
        )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: tuple[int, int],
) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (one layer); tables
    [B, MB] int32 block ids; lengths [B] int32 keys each row attends to (>= 1); splits from
    ``splits_for`` over MB -> [B, H, D] in q's dtype."""
    b, heads, dim = q.shape
    _, block, kv_heads, _ = k_cache.shape
    rep = heads // kv_heads
    n_splits, per = splits
    m = torch.empty(b, heads, n_splits, dtype=torch.float32, device=q.device)
    s_sum = torch.empty_like(m)
    acc = torch.empty(b, heads, n_splits, dim, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    d_pad = max(16, triton.next_power_of_2(dim))
    _partial_kernel[(b, kv_heads, n_splits)](
        q,
        k_cache,
        v_cache,
        tables,
        lengths,
        m,
        s_sum,
        acc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        n_splits,
        heads,
        REP=rep,
        REP_PAD=max(16, triton.next_power_of_2(rep)),
        D=dim,
        D_PAD=d_pad,
        BLOCK=block,
        PER_SPLIT=per,
    )
    _merge_kernel[(b, heads)](
        m,
        s_sum,
        acc,
        out,
        n_splits,
        out.stride(0),
        out.stride(1),
        heads,
        D=dim,
        D_PAD=d_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(n_splits)),
    )
    return out


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention by gathering each row's blocks (float32): [B, H, D]."""
    out = []
    for row in range(q.shape[0]):
        n = int(lengths[row])
        blocks = tables[row, : math.ceil(n / k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float().transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[row].float()[:, None], k, v, scale=scale, enable_gqa=True
        )  # [H, 1, D]
        out.append(o[:, 0])
    return torch.stack(out).to(q.dtype)
