"""A row's side that faces its consumer: made with its output tracker, given its sampled
tokens, and retired with an error or ``END`` when it leaves the batch.

``Handoff`` is a part of ``BatchEngine`` (``engine.handoff``), run on the engine thread (rows
are made on the event loops). A row leaves by finishing (``finish``: its last chunk, reason
included), by failing alone (``fail``: the error its consumer raises) or, never started, by
being dropped (``end``); its KV blocks are free at once. ``END`` goes out once every choice of
a request has ended. Everything a step hands off waits in the ``Outbox`` until the engine
delivers it (``BatchEngine._flush``); the forwards and the step loop are in ``engine.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vlmserve.engine.core.accept import accept
from vlmserve.engine.core.faults import request_error
from vlmserve.engine.core.outbox import END, Outbox
from vlmserve.engine.core.paging import NOT_SAMPLED
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import Group, SeqStatus, Sequence
from vlmserve.engine.guards import thinking_budget
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.tracker import OutputTracker
from vlmserve.engine.types import Chunk, FinishReason

__all__ = ["Handoff"]

log = logging.getLogger("vlmserve.engine.core.engine")


class Handoff:
    """Rows made, given their tokens and leaving the batch; their outputs in the outbox."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        hf_tokenizer: Any,
        vocab: int,
        eos_ids: set[int],
        steps: Callable[[], int],
    ) -> None:
        """``tokenizer``: the decoder of the rows' output trackers; ``hf_tokenizer``
        encodes the reasoning end and the thinking budget; ``steps()``: the engine's step
        count (stamped on a row as it leaves)."""
        self._scheduler, self._tokenizer, self._hf_tokenizer = scheduler, tokenizer, hf_tokenizer
        self._vocab, self._eos_ids, self._steps = vocab, eos_ids, steps
        self.outbox = Outbox()
        self.tokens_generated = 0

    # --- called from event loops ---------------------------------------------------------
    def new_sequence(self, prepared: Prepared, loop: Any, queue: Any) -> Sequence:
        """Choice 0 of a request; the others ride on it until its prefill (``choices.py``)."""
        head = self._sequence(prepared, loop, queue, 0)
        if (n := prepared.request.sampling.n) > 1:
            head.pending = [self._sequence(prepared, loop, queue, i) for i in range(1, n)]
            for seq in [head, *head.pending]:
                seq.group = Group(head, n) if seq is head else head.group
        return head

    def _sequence(self, prepared: Prepared, loop: Any, queue: Any, index: int) -> Sequence:
        req = prepared.request
        seq = Sequence(
            prepared,
            loop,
            queue,
            req.sampling.max_tokens - len(req.prefix_token_ids),
            priority=req.priority,
            media=req.has_media,
        )
        seq.index = index
        seq.run = OutputTracker(
            prepared, self._tokenizer, lambda chunk: self.emit(seq, chunk), index
        )
        end = getattr(prepared.parsers, "reasoning_end", None)
        if prepared.grammar is not None and end:  # the grammar starts after the reasoning
            seq.think_end = self._hf_tokenizer.encode(end, add_special_tokens=False)
        seq.budget = thinking_budget(prepared, self._hf_tokenizer)
        return seq

    # --- the engine thread --------------------------------------------------------------------
    def advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Record each row's new token, stream it, and retire rows that are done."""
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens, strict=True):
            if token == NOT_SAMPLED and (seq.output_ids or seq.chunk_row is not None):
                continue  # recomputing after a preemption, or prefilling: nothing new yet
            seq.first_at, seq.last_at = seq.first_at or now, now
            try:
                done = accept(seq, token, self._vocab, self._eos_ids)
            except Exception as exc:  # the grammar refused a token, an id out of range
                log.exception("request %s: token %d not accepted", _rid(seq), token)
                self.fail(seq, request_error(exc))
                continue
            if done:
                self.finish(seq)

    # --- leaving ------------------------------------------------------------------------------
    def finish(self, seq: Sequence, cancelled: bool = False) -> None:
        seq.run.finish(cancelled, self._eos_ids)
        self._retire(seq)
        self.end(seq)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        self._retire(seq)
        if seq.run is not None:
            seq.run.release()  # as after a finish: its media are freed with the row
        self.outbox.put(seq, exc)
        self.end(seq)

    def end(self, seq: Sequence) -> None:
        """Done; ``END`` once every choice is (choices never forked end with their head)."""
        dropped, seq.pending = seq.pending, []
        group = seq.group
        if group is not None:
            group.left -= 1 + len(dropped)
            if group.left > 0:
                return
            seq = group.head
        self.outbox.put(seq, END)  # the lifecycle forgets it once delivered (``_flush``)

    def _retire(self, seq: Sequence) -> None:
        seq.finished_step = self._steps()
        if seq.status is not SeqStatus.RUNNING:
            seq.status = SeqStatus.FINISHED
            return
        self._scheduler.remove(seq)  # its KV blocks are free at once

    # --- output -------------------------------------------------------------------------------
    def emit(self, seq: Sequence, chunk: Chunk) -> None:
        if seq.grammar_done and chunk.finish_reason is not None and not seq.cancelled:
            chunk.finish_reason = FinishReason.STOP  # the grammar is complete
        if chunk.finish_reason is not None:
            chunk.timings = seq.timings()
        self.tokens_generated += len(chunk.token_ids)
        self.outbox.put(seq, chunk)


def _rid(seq: Sequence) -> str:
    return seq.prepared.request.request_id
