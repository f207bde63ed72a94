"""The scheduler alone: admission order, the row bound, the prefill token budget, and the
dense slot layout that the KV cache relies on (rows leave, the last row fills the hole).

Sequences are real ``Sequence`` rows; only their prepared input is a stand-in carrying a
prompt length (the scheduler reads nothing else).
"""

from __future__ import annotations

from types import SimpleNamespace

from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence


def seq(prompt_tokens: int) -> Sequence:
    return Sequence(SimpleNamespace(prompt_tokens=prompt_tokens), None, None, 8)  # type: ignore[arg-type]


def queue(scheduler: Scheduler, *lengths: int) -> list[Sequence]:
    seqs = [seq(n) for n in lengths]
    for s in seqs:
        scheduler.add(s)
    return seqs


def test_requests_are_admitted_first_come_first_served_into_dense_slots() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=100)
    a, b, c = queue(scheduler, 5, 6, 7)
    assert scheduler.schedule() == [a, b, c]
    assert scheduler.running == [a, b, c]
    assert [s.slot for s in (a, b, c)] == [0, 1, 2]
    assert all(s.status is SeqStatus.RUNNING for s in (a, b, c))
    assert not scheduler.waiting
    assert scheduler.schedule() == []  # nothing left to admit


def test_at_most_max_num_seqs_rows_run_and_the_rest_wait_in_order() -> None:
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c, d = queue(scheduler, 1, 1, 1, 1)
    assert scheduler.schedule() == [a, b]
    assert list(scheduler.waiting) == [c, d]
    assert c.status is SeqStatus.WAITING and c.slot == -1
    assert scheduler.schedule() == []  # full
    scheduler.remove(a)
    assert scheduler.schedule() == [c]
    assert scheduler.running == [b, c] and [b.slot, c.slot] == [0, 1]


def test_one_step_prefills_prompts_up_to_the_token_budget_inclusive() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c, d = queue(scheduler, 5, 3, 4, 4)
    assert scheduler.schedule() == [a, b]  # 5 + 3 == 8 fits; + 4 would not
    assert scheduler.schedule() == [c, d]  # 4 + 4 == 8
    assert scheduler.running == [a, b, c, d]


def test_the_budget_counts_every_admitted_prompt_not_just_the_last() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=10)
    seqs = queue(scheduler, 3, 3, 3, 3)
    assert scheduler.schedule() == seqs[:3]  # 9; a fourth would make 12
    assert scheduler.schedule() == seqs[3:]


def test_a_prompt_over_the_budget_is_admitted_alone_and_never_starves() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    small, big, after = queue(scheduler, 2, 20, 1)
    assert scheduler.schedule() == [small]  # the big one would exceed the budget with it
    assert scheduler.schedule() == [big]  # alone, though over the budget
    assert scheduler.schedule() == [after]
    first = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    big2, tiny = queue(first, 9, 1)
    assert first.schedule() == [big2]  # first in line: admitted even though 9 > 8
    assert first.schedule() == [tiny]


def test_the_budget_stops_admission_at_the_first_prompt_that_does_not_fit() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c = queue(scheduler, 6, 4, 1)
    assert scheduler.schedule() == [a]  # FCFS: c would fit, but b is ahead of it
    assert scheduler.schedule() == [b, c]


def test_removing_a_middle_row_moves_the_last_row_into_its_slot() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=100)
    a, b, c, d = queue(scheduler, 1, 1, 1, 1)
    scheduler.schedule()
    assert scheduler.remove(b) is d
    assert scheduler.running == [a, d, c]
    assert d.slot == 1 and b.status is SeqStatus.FINISHED
    assert scheduler.remove(c) is None  # the last row: nothing moves
    assert scheduler.running == [a, d] and c.status is SeqStatus.FINISHED
    assert scheduler.remove(a) is d
    assert scheduler.running == [d] and d.slot == 0
    assert scheduler.remove(d) is None
    assert scheduler.running == [] and scheduler.idle


def test_idle_means_nothing_waiting_and_nothing_running() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=100)
    assert scheduler.idle
    (a,) = queue(scheduler, 3)
    assert not scheduler.idle  # waiting only
    scheduler.schedule()
    assert not scheduler.idle  # running only
    scheduler.remove(a)
    assert scheduler.idle


def test_a_cancelled_waiting_request_leaves_the_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=100)
    a, b, c = queue(scheduler, 1, 1, 1)
    scheduler.drop_waiting(b)
    assert list(scheduler.waiting) == [a, c] and b.status is SeqStatus.FINISHED
    assert scheduler.schedule() == [a]


def test_a_step_with_chunks_in_progress_admits_only_what_is_left_of_the_budget() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    a, b = queue(scheduler, 3, 5)
    assert scheduler.schedule(used=8) == []  # the chunks took the whole step
    assert scheduler.schedule(used=5) == [a]  # 5 + 3 == 8; b waits
    assert scheduler.schedule(used=3) == [b]


def test_rows_between_chunks_continue_oldest_first_within_the_budget() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c, d = queue(scheduler, 30, 20, 4, 30)
    for s in (a, b, c, d):
        scheduler.waiting.remove(s)
        scheduler._start(s)
    a.chunk_row, a.prefilled = object(), 24  # 6 tokens left
    b.chunk_row, b.prefilled = object(), 8  # 12 left: a chunk of 8
    d.chunk_row, d.prefilled = object(), 0
    assert scheduler.continuing(8) == ([a], 6)  # b's chunk would make 14 > 8
    a.chunk_row = None  # a finished its prompt
    assert scheduler.continuing(8) == ([b], 8)  # at least one, even when it fills the step
    b.prefilled = 16
    assert scheduler.continuing(8) == ([b], 4)  # 4 left; d's 8 would make 12


def test_several_short_chunks_share_a_step_up_to_the_budget_inclusive() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    rows = queue(scheduler, 20, 20, 20)
    for s in rows:
        scheduler.waiting.remove(s)
        scheduler._start(s)
        s.chunk_row = object()
    a, b, c = rows
    a.prefilled = b.prefilled = 16  # 4 left each: 8 together, inclusive
    assert scheduler.continuing(8) == ([a, b], 8)
    a.prefilled = b.prefilled = c.prefilled = 17  # 3 left each: a third would make 9
    assert scheduler.continuing(8) == ([a, b], 6)
