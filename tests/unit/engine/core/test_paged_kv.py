"""The paged KV cache under a memory budget: blocks, admission, preemption, the 400.

Pinned: the block manager's bookkeeping (null block, free list, growth, freeing); the
budget in blocks and the request that can never fit (``check_fits``: ``InvalidRequest``
naming the budget and the setting); the scheduler preempting the newest row and putting
it at the front of the queue; and, on the tiny real Qwen2-VL with a budget of about four
sequences, 32 concurrent 128-token image requests that all finish with exactly the tokens
and text each gives alone (greedy and seeded), with preemptions on the way and no token
streamed twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.unit.engine.core.test_batching import make_backend, request, run

from vlmserve.engine.core.block_manager import NULL_BLOCK, BlockManager
from vlmserve.engine.core.engine import END
from vlmserve.engine.core.kv_cache import KVBudget, PagedKVCache
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.models.profile import activation_peak, dummy_prefill
from vlmserve.engine.types import FinishReason
from vlmserve.errors import InvalidRequest

CPU = torch.device("cpu")


# --- block manager ------------------------------------------------------------------------
def test_blocks_are_handed_out_lowest_first_and_the_null_block_never() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)
    assert blocks.usable == 4 and blocks.usage == 0.0
    table: list[int] = []
    blocks.allocate(table, 9)  # 9 tokens -> 3 blocks
    assert table == [1, 2, 3] and NULL_BLOCK not in table
    assert blocks.take_fresh() == [1, 2, 3] and blocks.take_fresh() == []
    assert blocks.slot(table, 0) == 4 and blocks.slot(table, 9) == 3 * 4 + 1
    assert blocks.used == 3 and blocks.usage == 0.75
    blocks.check([table])


def test_append_slot_takes_a_block_only_at_a_block_boundary() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    blocks.allocate(table, 4)
    assert blocks.can_append(table, 3) and len(table) == 1
    assert blocks.append_slot(table, 3) == table[0] * 4 + 3 and len(table) == 1
    assert blocks.append_slot(table, 4) == table[1] * 4 and len(table) == 2
    blocks.append_slot(table, 8)
    assert len(table) == 3 and not blocks.free
    assert blocks.can_append(table, 11) and not blocks.can_append(table, 12)
    with pytest.raises(MemoryError):
        blocks.append_slot(table, 12)


def test_freed_blocks_are_reused_first_and_the_books_balance() -> None:
    blocks = BlockManager(num_blocks=6, block_size=2)
    a: list[int] = []
    b: list[int] = []
    blocks.allocate(a, 4)
    blocks.allocate(b, 2)
    assert not blocks.can_allocate(5) and blocks.can_allocate(4)
    freed = list(a)
    blocks.free_table(a)
    assert a == [] and blocks.used == 1
    c: list[int] = []
    blocks.allocate(c, 4)
    assert sorted(c) == sorted(freed)  # the working set stays small (LIFO)
    blocks.check([b, c])
    with pytest.raises(AssertionError):
        blocks.check([b, c, [b[0]]])  # a block owned twice


# --- budget -------------------------------------------------------------------------------
def test_the_budget_becomes_whole_blocks_of_every_layers_keys_and_values() -> None:
    per_block = 2 * 3 * 2 * 8 * 16 * 4  # (k, v) * layers * kv_heads * head_dim * tokens * fp32
    budget = KVBudget.plan(10 * per_block + 5, per_block, 16, CPU)
    assert budget.num_blocks == 10 and budget.nbytes == 10 * per_block
    assert budget.max_tokens == 9 * 16  # the null block holds nobody's tokens
    cache = PagedKVCache(3, 2, 8, budget.num_blocks, 16, torch.float32, CPU)
    assert cache.nbytes == budget.nbytes
    assert not cache.k[:, NULL_BLOCK].any() and not cache.v[:, NULL_BLOCK].any()


def test_a_budget_below_two_blocks_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="VLMSERVE_KV_CACHE_MEMORY"):
        KVBudget.plan(1000, 4096, 16, CPU)


def test_the_auto_budget_is_bounded_on_cpu() -> None:
    budget = KVBudget.plan(None, 4096, 16, CPU)
    assert 0 < budget.budget <= 4 * 2**30


def test_the_cuda_budget_is_what_the_utilization_leaves_less_a_prefills_activations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gib, mib = 2**30, 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))
    cuda = torch.device("cuda")
    budget = KVBudget.plan(None, mib, 16, cuda, utilization=0.8, reserve=gib)
    assert budget.budget == int(10 * gib - 0.2 * 16 * gib) - gib  # 5.8 GiB
    assert budget.num_blocks == budget.budget // mib
    assert KVBudget.plan(None, mib, 16, cuda, utilization=0.5).budget == 2 * gib
    assert KVBudget.plan(3 * mib, mib, 16, cuda, reserve=gib).budget == 3 * mib  # as set
    with pytest.raises(ValueError, match="GPU_MEMORY_UTILIZATION") as refused:
        KVBudget.plan(None, mib, 16, cuda, utilization=0.5, reserve=2 * gib)
    assert "1024.0 MiB" not in str(refused.value) and "2048.0 MiB kept for" in str(refused.value)


def test_a_request_that_can_never_fit_is_a_400_naming_budget_and_setting() -> None:
    per_block = 16 * 1024
    budget = KVBudget.plan(64 * per_block, per_block, 16, CPU)  # 63 usable blocks
    budget.check_fits(63 * 16 - 10, 10)  # exactly the whole cache: fits
    with pytest.raises(InvalidRequest) as info:
        budget.check_fits(63 * 16 - 10, 11)
    message = str(info.value)
    assert info.value.status_code == 400
    assert "1.0 MiB" in message
    assert "--kv-cache-memory" in message and "VLMSERVE_KV_CACHE_MEMORY" in message
    assert "max_tokens" in message


# --- scheduler ----------------------------------------------------------------------------
def seq(prompt_tokens: int) -> Sequence:
    return Sequence(SimpleNamespace(prompt_tokens=prompt_tokens), None, None, 64)  # type: ignore[arg-type]


def test_admission_waits_for_free_blocks_and_keeps_first_come_first_served() -> None:
    blocks = BlockManager(num_blocks=9, block_size=4)  # 8 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    a, b, c = seq(16), seq(12), seq(1)  # 4, 3 and 1 blocks
    for s in (a, b, c):
        scheduler.add(s)
    # a takes 4; b needs 3 + 1 spare block for a's growth = 4: fits; c needs 1 + 2 spare: not
    assert scheduler.schedule() == [a, b]
    assert list(scheduler.waiting) == [c] and c.status is SeqStatus.WAITING
    scheduler.remove(a)
    assert blocks.used == 3 and a.block_table == []
    assert scheduler.schedule() == [c]


def test_decode_out_of_blocks_preempts_the_newest_row_to_the_front_of_the_queue() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    old, new, late = seq(4), seq(3), seq(2)
    for s in (old, new):
        scheduler.add(s)
    assert scheduler.schedule() == [old, new]  # 1 + 1 blocks, 2 free
    scheduler.add(late)
    old.length, new.length = 4, 3
    assert scheduler.reserve_decode() == []  # old takes a second block, new still has room
    old.length, new.length = 7, 4
    assert scheduler.reserve_decode() == []  # new takes its second block: the cache is full
    old.length = 8
    assert scheduler.reserve_decode() == [new]  # old needs a block: the newest row goes
    assert new.status is SeqStatus.WAITING and new.block_table == [] and new.length == 0
    assert list(scheduler.waiting) == [new, late] and scheduler.running == [old]
    assert old.slot == 0 and len(old.block_table) == 3 and scheduler.preemptions == 1
    assert len(blocks.free) == 1
    blocks.check([old.block_table])


def test_a_lone_row_that_outgrows_the_cache_preempts_itself() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)  # 2 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    only = seq(8)
    scheduler.add(only)
    assert scheduler.schedule() == [only]
    only.length = 8
    assert scheduler.reserve_decode() == [only]
    assert scheduler.running == [] and list(scheduler.waiting) == [only]
    assert blocks.used == 0


# --- the engine under a budget of about four sequences ----------------------------------------
PROMPT_TEXT = "Describe picture {i} in detail."
TOKENS = 128


def crowd() -> list:
    """32 distinct image requests of 128 tokens; every 8th one samples with a seed."""
    out = []
    for i in range(32):
        sampled = i % 8 == 7
        out.append(
            request(
                PROMPT_TEXT.format(i=i),
                image=(56 + 8 * (i % 4), 56),
                image_seed=i,
                max_tokens=TOKENS,
                temperature=0.8 if sampled else 0.0,
                seed=1000 + i if sampled else None,
            )
        )
    return out


@pytest.fixture(scope="module")
def ample(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=32)
    yield b
    b.close()


async def test_32_image_streams_in_a_budget_of_4_finish_exactly_as_alone(
    tiny_dir: Path, ample: HFChatBackend
) -> None:
    reqs = crowd()
    alone = [await run(ample, r) for r in reqs]
    engine = ample.engine
    assert engine is not None and engine.gauges.preemptions == 0
    prompt = max([(await ample.prepare(r)).prompt_tokens for r in reqs])
    per_seq = -(-(prompt + TOKENS) // 16)
    budget = (4 * per_seq + 1) * engine.kv.block_bytes  # about 4 sequences' blocks
    small = make_backend(tiny_dir, max_num_seqs=32, max_queued=64, kv_cache_bytes=budget)
    try:
        tight = small.engine
        assert tight is not None and tight.gauges.kv_cache_bytes == budget
        together = await asyncio.gather(*(run(small, r) for r in reqs))
        assert tight.gauges.preemptions > 0, tight.gauges.preemptions
        for got, want in zip(together, alone, strict=True):
            assert got.tokens == want.tokens  # no token lost, none streamed twice
            assert got.text == want.text
            assert got.completion_tokens == TOKENS and got.finish == want.finish
        assert tight.gauges.kv_usage == 0.0  # every block back
        tight.blocks.check([])
    finally:
        small.close()


async def test_a_request_larger_than_the_budget_is_refused_by_the_engine_too(
    tiny_dir: Path, ample: HFChatBackend
) -> None:
    engine = ample.engine
    assert engine is not None
    req = request("Describe it. " * 10, image=(64, 48), max_tokens=16)
    prepared = await ample.prepare(req)  # prepared where it fits
    tiny_budget = 3 * engine.kv.block_bytes  # two usable blocks: 32 tokens
    small = make_backend(tiny_dir, kv_cache_bytes=tiny_budget)
    try:
        assert small.engine is not None
        with pytest.raises(InvalidRequest, match="VLMSERVE_KV_CACHE_MEMORY"):
            small.engine.gauges.check_fits(prepared.prompt_tokens, 16)
        with pytest.raises(InvalidRequest, match="MiB"):
            async for _ in small.generate(prepared):  # never asked check_fits: still a 400
                pass
        ok = await run(small, request("Hi", max_tokens=4))  # the engine goes on
        assert len(ok.tokens) == 4
    finally:
        small.close()


async def test_a_row_that_outgrows_the_whole_cache_alone_fails_with_the_400(
    tiny_dir: Path, ample: HFChatBackend
) -> None:
    """Only when ``check_fits`` was not asked: the row streams what fits, then the 400;
    the engine is not failed and serves the next request."""
    engine = ample.engine
    assert engine is not None
    prepared = await ample.prepare(request("Hi", max_tokens=200))
    small = make_backend(tiny_dir, kv_cache_bytes=5 * engine.kv.block_bytes)  # 64 tokens
    try:
        tokens: list[int] = []
        with pytest.raises(InvalidRequest, match="VLMSERVE_KV_CACHE_MEMORY"):
            async for chunk in small.generate(prepared):
                tokens += chunk.token_ids
        assert 0 < len(tokens) < 64 and small.engine is not None
        assert small.engine.failure is None and small.engine.gauges.preemptions >= 1
        assert len((await run(small, request("Hi", max_tokens=8))).tokens) == 8
    finally:
        small.close()


async def test_a_preempted_row_cancelled_while_waiting_ends_its_stream_as_cancelled(
    ample: HFChatBackend,
) -> None:
    engine = ample.engine
    assert engine is not None
    prepared = await ample.prepare(request("Hi", max_tokens=8))
    queue: asyncio.Queue = asyncio.Queue()
    seq = engine.new_sequence(prepared, asyncio.get_running_loop(), queue)
    seq.output_ids, seq.generated = [11, 12], 2  # streamed two tokens, then preempted
    seq.cancelled = True
    engine.scheduler.waiting.append(seq)
    engine._reap_cancelled()
    engine._flush()
    await asyncio.sleep(0)
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert not engine.scheduler.waiting and seq.status is SeqStatus.FINISHED
    assert items[-1] is END
    assert [c.finish_reason for c in items[:-1]] == [FinishReason.CANCELLED]


def test_the_profiling_prefill_runs_on_its_own_cache_and_gives_the_runner_its_own_back(
    ample: HFChatBackend,
) -> None:
    assert ample.engine is not None
    runner = ample.engine.runner
    own = runner.cache
    logits = dummy_prefill(runner, 300, 16)  # more tokens than a block, not a whole number
    assert logits.shape == (1, ample.engine.vocab) and torch.isfinite(logits).all()
    assert runner.cache is own
    assert activation_peak(runner, 300, 16) == 0  # measured on CUDA only


def test_gpu_memory_utilization_reaches_the_engine(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, gpu_memory_utilization=0.55)
    try:
        assert backend.engine is not None and backend.engine.paging.utilization == 0.55
    finally:
        backend.close()
