"""``Scheduler.fork`` (the other choices of an n > 1 request start from a copy of the head's
prompt KV) and preemption of the row asking for room: the bounds an admission has, checked
on the block books. Real ``Sequence`` rows; only the prepared input is a stand-in carrying a
prompt length (the scheduler reads nothing else)."""

from __future__ import annotations

from types import SimpleNamespace

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence
from vlmserve.engine.types import BATCH_PRIORITY, INTERACTIVE_PRIORITY


def row(prompt_tokens: int = 4) -> Sequence:
    prepared = SimpleNamespace(prompt_tokens=prompt_tokens)
    return Sequence(prepared, None, None, 64, priority=INTERACTIVE_PRIORITY)  # type: ignore[arg-type]


def test_a_fork_gets_the_prompts_blocks_and_the_next_row() -> None:
    blocks = BlockManager(num_blocks=9, block_size=4)  # 8 usable
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=100, blocks=blocks)
    head = row(prompt_tokens=6)
    scheduler.add(head)
    assert scheduler.schedule() == [head]
    sibling = row(prompt_tokens=6)
    assert scheduler.fork(sibling, 6)
    assert sibling.status is SeqStatus.RUNNING and sibling.slot == 1
    assert scheduler.running == [head, sibling]
    assert len(sibling.block_table) == 2  # 6 tokens in blocks of 4
    assert not set(sibling.block_table) & set(head.block_table)
    assert sibling.admitted > head.admitted  # the newest row: preempted first
    blocks.check([head.block_table, sibling.block_table])


def test_a_fork_waits_when_no_row_is_free() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=100)
    head = row()
    scheduler.add(head)
    assert scheduler.schedule() == [head]
    sibling = row()
    assert not scheduler.fork(sibling, 4)
    assert sibling.status is SeqStatus.WAITING and scheduler.running == [head]


def test_a_fork_leaves_one_spare_block_per_running_row() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, blocks=blocks)
    head = row(prompt_tokens=8)
    scheduler.add(head)
    assert scheduler.schedule() == [head]  # 2 blocks, 2 free
    assert not scheduler.fork(row(prompt_tokens=8), 8)  # 2 blocks + 1 spare > 2 free
    assert len(blocks.free) == 2 and scheduler.running == [head]
    small = row(prompt_tokens=4)
    assert scheduler.fork(small, 4)  # 1 block + 1 spare <= 2 free
    assert len(blocks.free) == 1 and len(small.block_table) == 1


def test_the_row_asking_for_room_is_preempted_when_it_is_the_newest() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)  # 2 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    old, new = row(), row()
    scheduler.add(old)
    assert scheduler.schedule() == [old]
    scheduler.add(new)
    assert scheduler.schedule() == []  # 1 block + 1 spare for old: none left for new
    assert scheduler.fork(new, 4) is False
    # old runs alone and grows: its second block is the last free one
    old.length = 4
    assert scheduler.reserve_decode() == [] and len(old.block_table) == 2
    old.length = 8  # needs a third block: none free, and old is the only (newest) row
    assert scheduler.reserve_decode() == [old]
    assert scheduler.running == [] and old.status is SeqStatus.WAITING
    assert len(blocks.free) == 2  # everything it held is back


def test_after_preempting_a_newer_row_the_older_one_gets_its_slot() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)  # 3 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    a, b = row(), row()
    scheduler.add(a)
    assert scheduler.schedule() == [a]
    scheduler.add(b)
    assert scheduler.schedule() == [b]  # 1 + 1, one free
    a.length, b.length = 4, 4  # both need a second block; one is free
    assert scheduler.reserve_decode() == [b]  # a (older) takes it after b is preempted
    assert scheduler.running == [a] and len(a.block_table) == 2
    assert list(scheduler.waiting) == [b]
    blocks.check([a.block_table])


def test_rows_after_a_preempted_batch_row_still_get_their_room() -> None:
    """Oldest first: interactive i1 needs a block, the batch row (admitted after it) is the
    victim; the newer interactive i2, visited after that preempted row, must still get room."""
    blocks = BlockManager(num_blocks=7, block_size=4)  # 6 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    i1 = row()
    b = Sequence(SimpleNamespace(prompt_tokens=4), None, None, 64, priority=BATCH_PRIORITY)  # type: ignore[arg-type]
    i2 = row()
    for seq in (i1, b, i2):
        scheduler.add(seq)
        assert scheduler.schedule() == [seq]  # one block each, admitted in this order
    i1.length, b.length = 4, 4
    assert scheduler.reserve_decode() == []  # a second block each: 1 free
    i1.length = 8
    assert scheduler.reserve_decode() == [] and not blocks.free  # i1's third: none free
    i1.length, i2.length = 12, 4  # both need one more: the batch row goes (2 blocks back)
    assert scheduler.reserve_decode() == [b]
    assert scheduler.running == [i1, i2]
    assert len(i1.block_table) == 4 and len(i2.block_table) == 2
    blocks.check([i1.block_table, i2.block_table])
