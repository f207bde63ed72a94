"""Decode attention on CPU that reads the paged KV cache where it lies (inductor's C++).

``paged_decode`` is written in torch ops: each row's keys and values are indexed through its
block table (``k_cache[tables]``) inside the reductions that consume them, in the cache's
dtype, with float32 scores and sums. Run eagerly that indexing would copy every row's blocks
(what ``PagedKVCache.gather`` does); ``torch.compile`` (inductor's C++ backend) fuses it into
the kernels, so a step reads each row's blocks once, nothing is gathered or cast, and a bf16
model's attention runs on bf16 keys and values (no float32 copy).

Batch invariance: in the kernels inductor generates here every reduction over a row's keys is
a sequential loop inside one row (vectorised across heads or head_dim, never across keys),
and the kernel runs on one thread, so a row's result does not depend on its companions or
the thread count; positions past a row's length (up to the batch's widest
table, read from the zeroed null block) add exact zeros after its last key. One kernel serves
every batch size and width: the batch and table-width dimensions are compiled dynamic, and a
batch of one row or of one-block tables is padded to two (a dimension of size 1 would be
compiled as a constant: another kernel, other rounding).

Compiling costs seconds once (``warm_up``, at engine start); inductor's on-disk cache makes
later starts load the kernel. Where compiling is impossible (no C++ compiler, a compile
error) the runner keeps gathered attention and the log says why.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

__all__ = ["CompiledAttention", "paged_decode"]

log = logging.getLogger(__name__)
RECOMPILE_LIMIT = 64  # one compiled graph per head layout and dtype: many models in a process


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (one layer); tables
    [B, MB] block ids (padded with the null block); lengths [B] keys each row attends to
    (>= 1) -> [B, H, D] in q's dtype. Eagerly this gathers; compiled (``CompiledAttention``)
    the indexing happens inside the kernels."""
    b, heads, dim = q.shape
    _, block, kv_heads, _ = k_cache.shape
    rep, width = heads // kv_heads, tables.shape[1]
    qf = q.float().view(b, 1, 1, kv_heads, rep, dim)
    keys = k_cache[tables].float()  # [B, MB, BS, KVH, D]: indexed loads once compiled
    scores = (qf * keys[..., None, :]).sum(-1) * scale  # [B, MB, BS, KVH, rep]
    pos = torch.arange(width * block, device=q.device).view(1, width, block, 1, 1)
    scores = scores.masked_fill(pos >= lengths.view(b, 1, 1, 1, 1), float("-inf"))
    top = scores.amax(dim=(1, 2), keepdim=True)
    p = torch.exp(scores - top)
    total = p.sum(dim=(1, 2))  # [B, KVH, rep]
    values = v_cache[tables].float()
    out = (p[..., None] * values[..., None, :]).sum(dim=(1, 2))  # [B, KVH, rep, D]
    return (out / total[..., None]).view(b, heads, dim).to(q.dtype)


def _cache_per_isa() -> None:
    """Under an ISA cap (``ATEN_CPU_CAPABILITY``) keep inductor's on-disk cache in a folder of
    its own: a kernel cached by a capped process and loaded by an uncapped one, or the other
    way round, computes NaN or corrupts memory (measured on torch 2.14, AVX-512 and avx2)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    base = cache_dir()
    if cap and os.path.basename(base) != f"isa-{cap}":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"isa-{cap}")


class CompiledAttention:
    """``paged_decode`` compiled by inductor, batch and table width dynamic."""

    def __init__(self) -> None:
        _cache_per_isa()
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        # one thread inside the kernel: its OpenMP (the compiler's) and torch's spin against
        # each other between layers; on 2 busy cores a 2-thread kernel made the 8 x 4,096
        # step 5x slower (504 against 95 ms)
        self._fn: Any = torch.compile(paged_decode, dynamic=False, options={"cpp.threads": 1})
        self.broken = False  # a call needed compiling again: eager from then on
        self._threads: set[int] = set()  # torch thread counts compiled for (dynamo guards it)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``paged_decode``'s contract; tables and lengths int64. Runs the kernel compiled by
        ``warm_up``: the inputs are made alike (fresh contiguous inference tensors, at least
        2 rows of 2 blocks), so its guards hold; a call that would compile again runs
        ``paged_decode`` eagerly instead (correct, but gathering) and the log says so."""
        b = q.shape[0]
        with torch.inference_mode():
            q, tables, lengths = q.clone(), tables.clone(), lengths.clone()
            if b < 2:  # a padding row: one key of the null block
                q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
                tables = torch.cat([tables, tables.new_zeros(1, tables.shape[1])])
                lengths = torch.cat([lengths, lengths.new_ones(1)])
            if tables.shape[1] < 2:  # a null block past every row's keys
                tables = torch.cat([tables, tables.new_zeros(tables.shape[0], 1)], 1)
            args = (q, k_cache, v_cache, tables, lengths, scale)
            if torch.get_num_threads() not in self._threads and not self.broken:
                self.warm_up(q, k_cache, v_cache, scale)  # the same kernel: seconds, once
            if not self.broken:
                try:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        return self._fn(*args)[:b]
                except RuntimeError as exc:
                    self.broken = True
                    log.warning("CPU paged attention runs eagerly (gathering): %s", exc)
            return paged_decode(*args)[:b]

    def warm_up(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> float:
        """Compile for these head shapes and dtype (q [B, H, D], any B) and the current
        thread count: one call on the null block, 2 rows of 3-block tables (distinct sizes:
        dimensions of equal size would be compiled as one) -> seconds taken. Raises
        whatever compiling raises."""
        started = time.perf_counter()
        self._threads.add(torch.get_num_threads())
        with torch.inference_mode():  # as ``__call__`` makes its inputs
            q = q.new_zeros(2, *q.shape[1:])
            tables = torch.zeros(2, 3, dtype=torch.long, device=q.device)
            lengths = torch.ones(2, dtype=torch.long, device=q.device)
            for t, dim in ((q, 0), (tables, 0), (lengths, 0)):
                torch._dynamo.mark_dynamic(t, dim)  # the cache's shape stays: its own kernel
            # the width unbacked: no guard on it, so no second kernel past 4,096 keys (where
            # inductor would switch its float sums to chunked ones: other rounding)
            torch._dynamo.decorators.mark_unbacked(tables, 1)
            self._fn(q, k_cache, v_cache, tables, lengths, scale)
        seconds = time.perf_counter() - started
        log.debug("compiled the CPU paged decode attention in %.1f s", seconds)
        return seconds
