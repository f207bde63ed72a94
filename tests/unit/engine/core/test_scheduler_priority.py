"""Batch work below interactive traffic inside the scheduler: a waiting interactive request is
admitted before waiting batch lines, a bounded number of times (batch work is never starved),
preempted rows keep the front, and out of KV blocks a batch row goes before interactive ones.

Sequences are real ``Sequence`` rows; only their prepared input is a stand-in carrying a
prompt length (the scheduler reads nothing else).
"""

from __future__ import annotations

from types import SimpleNamespace

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence
from vlmserve.engine.types import BATCH_PRIORITY, INTERACTIVE_PRIORITY


def seq(priority: int, prompt_tokens: int = 4) -> Sequence:
    prepared = SimpleNamespace(prompt_tokens=prompt_tokens)
    return Sequence(prepared, None, None, 64, priority=priority)  # type: ignore[arg-type]


def batch(n: int = 1) -> list[Sequence]:
    return [seq(BATCH_PRIORITY) for _ in range(n)]


def interactive(n: int = 1) -> list[Sequence]:
    return [seq(INTERACTIVE_PRIORITY) for _ in range(n)]


def test_a_waiting_interactive_request_is_admitted_before_waiting_batch_lines() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=100)
    b1, b2 = batch(2)
    (i1,) = interactive()
    for s in (b1, b2, i1):
        scheduler.add(s)
    assert list(scheduler.waiting) == [i1, b1, b2]
    assert scheduler.schedule() == [i1]
    assert (b1.overtaken, b2.overtaken) == (1, 1)


def test_each_class_stays_first_come_first_served() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    b1, b2 = batch(2)
    i1, i2 = interactive(2)
    for s in (b1, i1, b2, i2):
        scheduler.add(s)
    assert list(scheduler.waiting) == [i1, i2, b1, b2]
    assert scheduler.schedule() == [i1, i2, b1, b2]


def test_a_batch_line_is_overtaken_at_most_max_overtakes_times() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=100, max_overtakes=2)
    (b1,) = batch()
    scheduler.add(b1)
    i1, i2, i3 = interactive(3)
    for s in (i1, i2, i3):
        scheduler.add(s)
    assert list(scheduler.waiting) == [i1, i2, b1, i3]  # b1 keeps its place after 2
    order = []
    for _ in range(4):
        (row,) = scheduler.schedule()
        order.append(row)
        scheduler.remove(row)
    assert order == [i1, i2, b1, i3]


def test_a_preempted_batch_row_keeps_the_front_of_the_queue() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    (b1,) = batch()
    scheduler.add(b1)
    assert scheduler.schedule() == [b1]
    scheduler.preempt(b1)
    (i1,) = interactive()
    scheduler.add(i1)
    assert list(scheduler.waiting) == [b1, i1] and b1.status is SeqStatus.WAITING


def test_out_of_blocks_the_batch_row_is_preempted_before_a_newer_interactive_row() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, blocks=blocks)
    (old,) = batch()
    (new,) = interactive()
    scheduler.add(old)
    assert scheduler.schedule() == [old]
    scheduler.add(new)
    assert scheduler.schedule() == [new]  # 1 + 1 blocks, 2 free
    old.length, new.length = 7, 7
    assert scheduler.reserve_decode() == []  # both take their second block: full
    new.length = 8
    # new (interactive, admitted last) needs a block: the batch row goes, not new
    assert scheduler.reserve_decode() == [old]
    assert scheduler.running == [new] and list(scheduler.waiting) == [old]
    blocks.check([new.block_table])
