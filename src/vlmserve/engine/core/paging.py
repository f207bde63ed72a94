"""The engine's side of the paged KV cache: the budget, the blocks, recompute after preemption.

``KVPaging`` sizes the cache from the budget (``KVBudget.plan``), allocates it once through
the runner, and owns the ``BlockManager`` the scheduler admits and preempts with. A row that
was preempted is recomputed when readmitted: its prompt is prefilled again and the tokens it
had already sampled and streamed are fed back one decode step each (``Sequence.replay``),
their logits discarded. Its KV then holds exactly what an uninterrupted run computed (the
decode step is batch invariant), its RNG, grammar matcher and penalty state were never
touched, so its next tokens are those of the uninterrupted run and nothing is emitted
twice. (vLLM recomputes prompt + output in one prefill: faster, but a prefill's K/V round
differently from the decode steps', so greedy output could change after a preemption.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.kv_cache import GPU_MEMORY_UTILIZATION, KVBudget
from vlmserve.engine.core.sequence import Sequence
from vlmserve.engine.models.cpu_kernels import settle_linears
from vlmserve.engine.models.profile import activation_peak
from vlmserve.engine.models.runner import DecoderRunner, PrefillRow

if TYPE_CHECKING:
    from vlmserve.engine.configs import ChatEngineConfig

__all__ = ["NOT_SAMPLED", "KVPaging", "build_paging", "whole_blocks"]

NOT_SAMPLED = -1  # a forward's "token" for a row that is recomputing tokens it streamed


def whole_blocks(blocks: torch.Tensor | None, start: int, end: int) -> int:
    """Where a chunk ``start``..``end`` of a prompt ends so that no image block is split
    (Gemma 3: an image's tokens attend to each other both ways, so they are computed in
    one forward): before the block ``end`` falls in, or after it when the block starts at
    or before ``start`` (a chunk is then longer than the budget by at most one image)."""
    if blocks is None or end >= blocks.numel() or end <= 0:
        return end
    block = int(blocks[end - 1])
    if block < 0 or int(blocks[end]) != block:
        return end
    where = (blocks == block).nonzero()
    first, last = int(where[0, 0]), int(where[-1, 0])
    return first if first > start else last + 1


class KVPaging:
    def __init__(
        self,
        runner: DecoderRunner,
        kv_cache_bytes: int | None,
        block_size: int,
        utilization: float = GPU_MEMORY_UTILIZATION,
        max_prefill_tokens: int = 0,
        prefix_caching: bool = False,
    ) -> None:
        """``kv_cache_bytes`` None: the automatic budget, less (on CUDA) the activations of
        a ``max_prefill_tokens`` prefill (``profile.activation_peak``)."""
        self.runner = runner
        self.utilization = utilization
        reserve = 0
        if not kv_cache_bytes and max_prefill_tokens > 0:
            reserve = activation_peak(runner, max_prefill_tokens, block_size)
        self.budget = KVBudget.plan(
            kv_cache_bytes,
            runner.block_bytes(block_size),
            block_size,
            runner.device,
            utilization=utilization,
            reserve=reserve,
        )
        runner.allocate_cache(self.budget.num_blocks, block_size)
        self.blocks = BlockManager(self.budget.num_blocks, block_size, prefix_caching)

    def oversized(self, waiting: Any) -> list[tuple[Sequence, BaseException]]:
        """Waiting rows the whole cache can never hold, each with its 400 (``check_fits``
        refuses such requests before they start; this catches callers that did not ask,
        and rows that outgrew the cache while generating)."""
        out: list[tuple[Sequence, BaseException]] = []
        for seq in waiting:
            if self.blocks.fits(seq.kv_need):
                continue
            try:
                self.budget.check_fits(seq.prompt_len, max(seq.max_new, len(seq.output_ids) + 1))
            except Exception as exc:
                out.append((seq, exc))
            else:  # check_fits is the looser test (prompt + max_tokens); never reached
                out.append((seq, MemoryError("the KV cache cannot hold this request")))
        return out

    def prompt_slots(self, seq: Sequence) -> list[int]:
        """Cache slots of the prompt tokens this forward computes: ``seq.prefilled`` (its
        cached prefix, or the chunks done) to ``seq.chunk_end`` (blocks allocated, or shared,
        at admission)."""
        self.clear_fresh()
        return [self.blocks.slot(seq.block_table, i) for i in range(seq.prefilled, seq.chunk_end)]

    @staticmethod
    def next_chunk(seq: Sequence, row: PrefillRow, size: int) -> PrefillRow:
        """What this step computes of ``seq``'s prompt (``row``, all of it): from
        ``seq.prefilled`` (its cached prefix, or the chunks done) on, at most ``size`` tokens
        (a longer prompt keeps ``row`` in ``seq.chunk_row`` for the next steps). A part after
        the start attends to the K/V before it through the row's block table."""
        start, total = seq.prefilled, seq.prompt_len
        seq.chunk_end = end = whole_blocks(row.blocks, start, min(total, start + size))
        seq.chunk_row = row if (end < total or seq.chunk_row is not None) else None
        if start == 0 and end == total:
            return row
        positions = row.positions
        if positions is None:
            positions = torch.arange(total, device=row.embeds.device).expand(3, total)
        part = PrefillRow(
            row.embeds[start:end],
            positions[:, start:end],
            cached=start,
            table=list(seq.block_table) if start else None,
        )
        if row.blocks is not None:  # Gemma 3: the image blocks of every key up to ``end``
            part.blocks = row.blocks[:end]
        if row.visual is not None and row.deepstack is not None:  # Qwen3-VL: this part's
            keep = (row.visual >= start) & (row.visual < end)
            if keep.any():
                part.visual, part.deepstack = row.visual[keep] - start, row.deepstack[:, keep]
        return part

    @staticmethod
    def chunk_done(seq: Sequence) -> bool:
        """After a prefill forward: the prompt is computed up to ``chunk_end``; True when
        that was its end (the row samples and starts decoding)."""
        seq.prefilled = seq.chunk_end
        if seq.prefilled < seq.prompt_len:
            return False
        seq.chunk_row = None
        return True

    def prompt_done(self, seq: Sequence) -> None:
        """After the prefill of its whole prompt: the row decodes from its length on (after
        feeding back what it had streamed, if recomputed), its full prompt blocks are
        findable by later prompts, and its usage says how much came from the cache."""
        self.after_prefill(seq)
        if seq.block_hashes:
            self.blocks.register(seq.block_table, seq.block_hashes)
        if self.blocks.prefix_caching and seq.run is not None and not seq.output_ids:
            seq.run.cached_tokens = seq.cached

    def clear_fresh(self) -> None:
        """Zero the blocks handed out since the last forward (before they are read)."""
        cache = self.runner.cache
        if cache is not None:
            cache.clear(self.blocks.take_fresh())

    def copy_prompt(self, source: Sequence, target: Sequence) -> None:
        """Copy the KV blocks of ``source``'s prompt into ``target``'s (just allocated, same
        count): another choice of the same request starts from the prompt's K/V without a
        prefill of its own. Fresh blocks are zeroed first, so nothing clears the copy."""
        self.clear_fresh()
        cache = self.runner.cache
        count = self.blocks.blocks_for(source.prompt_len)
        if cache is None or count == 0:
            return
        src = torch.tensor(source.block_table[:count], device=cache.k.device)
        dst = torch.tensor(target.block_table[:count], device=cache.k.device)
        cache.k[:, dst] = cache.k[:, src]  # [layers, count, block_size, kv_heads, head_dim]
        cache.v[:, dst] = cache.v[:, src]

    @staticmethod
    def recomputing(seq: Sequence) -> bool:
        """Whether this forward's logits for ``seq`` give no new token: a token it already
        streamed (its prefill after a preemption, a replay step), or a chunk of a prompt
        before its last."""
        return bool(seq.replay) or (bool(seq.output_ids) and seq.length == 0) or seq.prefilling

    @staticmethod
    def after_prefill(seq: Sequence) -> None:
        seq.length = seq.prompt_len
        if seq.output_ids:  # recomputed: feed back the tokens it had streamed
            seq.next_token, *rest = seq.output_ids
            seq.replay.extend(rest)

    @staticmethod
    def after_decode(seq: Sequence) -> None:
        seq.length += 1
        if seq.replay:
            seq.next_token = seq.replay.popleft()

    def sample(self, sampler: Any, logits: torch.Tensor, rows: list[Sequence]) -> list[int]:
        """Tokens of the rows that sample (logits [B, V]); ``NOT_SAMPLED`` for the rows
        that are recomputing (their logits are dropped: no RNG draw, no grammar step)."""
        live = [i for i, s in enumerate(rows) if not self.recomputing(s)]
        if len(live) == len(rows):
            return sampler.sample(logits, rows)
        tokens = [NOT_SAMPLED] * len(rows)
        if live:
            index = torch.tensor(live, device=logits.device)
            picked = sampler.sample(logits[index], [rows[i] for i in live])
            for i, token in zip(live, picked, strict=True):
                tokens[i] = token
        return tokens


def build_paging(
    runner: DecoderRunner, c: ChatEngineConfig, block_size: int
) -> tuple[KVPaging, str]:
    """The KV budget (0: ``kv_cache.auto_budget`` less a prefill's activations on CUDA),
    allocated once, in blocks; then how decode reads it (``--cuda-graphs``), named for the log.
    """
    paging = KVPaging(
        runner,
        c.kv_cache_bytes or None,
        block_size,
        c.gpu_memory_utilization,
        c.max_num_batched_tokens,
        c.prefix_caching,
    )
    if c.cuda_graphs:
        mode = runner.use_paged_decode(c.max_num_seqs, c.max_model_len, graphs=not c.enforce_eager)
    elif _compiles_attention(runner, c):
        mode = runner.use_compiled_attention()
    else:
        settle_linears(runner)  # no C library asked for: pack what waited for its kernel
        mode = "gathered attention"
    return paging, mode


def _compiles_attention(runner: DecoderRunner, c: ChatEngineConfig) -> bool:
    """CPU decode attention in place (the C kernel, ``cpu_attention.py``) for every dtype:
    the gathered path copies every row's context per step (and upcasts a half-precision
    one); ``--enforce-eager`` keeps gathering."""
    return runner.device.type == "cpu" and not c.enforce_eager
