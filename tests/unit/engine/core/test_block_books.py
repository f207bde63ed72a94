"""The KV block books in detail: limits, growth by one token, the invariant check, and how
preemptions are counted (what the paged-KV tests leave implicit; found by mutation testing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlmserve.engine.core.block_manager import NULL_BLOCK, BlockManager
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence


def seq(prompt_tokens: int) -> Sequence:
    return Sequence(SimpleNamespace(prompt_tokens=prompt_tokens), None, None, 64)  # type: ignore[arg-type]


def test_two_blocks_is_the_smallest_cache_and_one_is_refused_saying_so() -> None:
    assert BlockManager(2, 16).usable == 1  # the null block and one real block
    with pytest.raises(ValueError, match="at least 2 blocks, got 1"):
        BlockManager(1, 16)


def test_fits_is_the_whole_cache_exactly() -> None:
    blocks = BlockManager(5, 4)  # 4 usable blocks = 16 tokens
    assert blocks.fits(16) and not blocks.fits(17)


def test_allocating_past_the_free_blocks_says_how_many_were_needed() -> None:
    blocks = BlockManager(3, 4)  # 2 usable
    table: list[int] = []
    with pytest.raises(MemoryError, match="3 blocks needed, 2 free"):
        blocks.allocate(table, 9)
    assert table == [] and len(blocks.free) == 2  # nothing taken


def test_append_slot_grows_the_table_to_hold_exactly_that_token() -> None:
    blocks = BlockManager(9, 4)
    table: list[int] = []
    blocks.allocate(table, 4)
    assert blocks.append_slot(table, 3) == table[0] * 4 + 3 and len(table) == 1
    slot = blocks.append_slot(table, 7)  # token 7 lives in the second block
    assert len(table) == 2 and slot == table[1] * 4 + 3


def test_the_invariant_check_names_what_is_wrong() -> None:
    blocks = BlockManager(5, 4)
    a: list[int] = []
    blocks.allocate(a, 4)
    blocks.check([a])  # consistent: passes
    with pytest.raises(AssertionError, match="reference counts disagree"):
        blocks.check([a, list(a)])  # a block owned twice, but counted once
    with pytest.raises(AssertionError, match="overlap the free blocks or hold the null one"):
        blocks.check([a, [NULL_BLOCK]])  # the null block is never owned
    with pytest.raises(AssertionError, match="overlap the free blocks or hold the null one"):
        blocks.check([a, [blocks.free[-1]]])  # owned and free at once
    blocks.free.pop()  # a block lost from the books
    with pytest.raises(AssertionError, match="1 owned \\+ 2 spare != 4"):
        blocks.check([a])


def test_each_preemption_is_counted_on_the_row_and_the_scheduler() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)  # 2 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    first, second = seq(4), seq(1)
    for s in (first, second):
        scheduler.add(s)
    assert scheduler.schedule() == [first]
    assert (first.admitted, first.slot) == (0, 0)
    for rounds in (1, 2):
        scheduler.preempt(first)
        assert first.status is SeqStatus.WAITING and first.slot == -1 and first.length == 0
        assert first.preempted == rounds and scheduler.preemptions == rounds
        assert scheduler.schedule()[0] is first  # back at the front of the queue
    assert first.admitted == 2  # the third admission: numbered in order from 0
