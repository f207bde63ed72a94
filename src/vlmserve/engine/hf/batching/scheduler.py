"""Which waiting requests join the running batch this step (first come, first served).

Bounds: at most ``max_num_seqs`` rows decode together, and one step prefills at most
``max_num_batched_tokens`` prompt tokens (several waiting requests may prefill in the same
forward). A prompt longer than the budget is admitted alone, never starved. Rows live in
``running`` in slot order: ``running[i].slot == i``, so the decode batch is dense.
"""

from __future__ import annotations

from collections import deque

from vlmserve.engine.hf.batching.sequence import SeqStatus, Sequence

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """Move the requests that fit from ``waiting`` to ``running``; return them (to prefill)."""
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and tokens + seq.prompt_len > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            tokens += seq.prompt_len
            seq.slot = len(self.running)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def drop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def remove(self, seq: Sequence) -> Sequence | None:
        """Take a running row out; the last row moves into its slot. Returns the moved row
        (its KV must follow: ``cache.move(moved_from, seq.slot)``) or None."""
        slot = seq.slot
        last = self.running.pop()
        seq.status = SeqStatus.FINISHED
        if last is seq:
            return None
        self.running[slot] = last
        last.slot = slot
        return last
