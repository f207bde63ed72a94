"""Which waiting requests join the running batch this step, and who leaves when the KV
cache is full (vLLM's scheduler, first come, first served, preemption by recompute).

Bounds: at most ``max_num_seqs`` rows decode together, one step prefills at most
``max_num_batched_tokens`` prompt tokens (several waiting requests may prefill in the same
forward; a prompt longer than that is admitted alone, never starved), and with a
``BlockManager`` a request is admitted only when the KV blocks of its prompt (plus the
tokens it had generated before a preemption) are free, with one block to spare per
running row. The head of the queue waits for room; nobody overtakes it but text passing
media, below.

Text before pictures: when text prompts and media prompts wait together, a step admits the
text ones and the media ones follow in the next step. The vision tower runs while a step's
prompts are embedded, so a text prompt admitted beside a photo would wait for the photo's
encoder before its own first token; the photo waits one short step instead. Only text of
the same or a better priority goes first, at most ``MEDIA_DEFERRALS`` times per media
prompt, never past a preempted one.

Priorities: a request of a lower ``priority`` value (interactive: 0) is queued ahead of
waiting requests of a higher one (batch work: 1), unless the waiting one has already been
overtaken ``max_overtakes`` times: then it keeps its place, so batch work is delayed, never
starved. Preempted rows go back to the front whatever their priority.

When a decode step needs a new block and none is free, the most recently admitted running
row of the highest ``priority`` value (batch work before interactive rows) is **preempted**:
its blocks are freed and it goes back to the *front* of the queue, to be recomputed later.
Rows live in ``running`` in slot order (``running[i].slot == i``), so the decode batch is
dense.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.sequence import SeqStatus, Sequence

__all__ = ["MEDIA_DEFERRALS", "Scheduler"]

# Steps a media prompt may wait for text prompts queued behind it: under a steady stream of
# text it still starts within this many steps.
MEDIA_DEFERRALS = 4


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        blocks: BlockManager | None = None,
        max_overtakes: int = 64,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_overtakes = max_overtakes  # per waiting request: its starvation bound
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = blocks  # None: no KV budget (scheduler tests)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._admissions = 0
        # prefix caching (``blocks.prefix_caching``): a row's block keys (``prefix.py``)
        self.prefix_hasher: Callable[[Sequence], list[bytes]] | None = None
        self.prefix_queried = 0  # prompt tokens of fresh admissions (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of those, tokens whose K/V came from the prefix cache

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``: at the back, or ahead of the lower-priority requests (higher value)
        that may still be overtaken; each of those counts one overtake."""
        place = len(self.waiting)
        while place > 0:
            other = self.waiting[place - 1]
            if (
                other.priority <= seq.priority
                or other.overtaken >= self.max_overtakes
                or other.preempted
            ):  # a preempted row keeps the front
                break
            place -= 1
        for i in range(place, len(self.waiting)):
            self.waiting[i].overtaken += 1
        self.waiting.insert(place, seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, used: int = 0) -> list[Sequence]:
        """Move the requests that fit from ``waiting`` to ``running``; return them (to prefill).
        ``used``: prompt tokens this step already computes (chunks of long prompts). A prompt
        longer than ``max_num_batched_tokens`` costs one chunk of that size per step.

        Media prompts wait a step for the text prompts of their priority or a better one
        queued behind them (``_passed_over``): their vision tower would otherwise run in the
        step that gives those text prompts their first token."""
        passed = self._passed_over()
        admitted = self._admit(used, passed)
        if passed and not admitted:  # nothing behind them fits now: they go ahead after all
            admitted = self._admit(used, set())
        elif passed:
            for seq in self.waiting:
                seq.deferred += id(seq) in passed
        return admitted

    def _admit(self, used: int, passed: set[int]) -> list[Sequence]:
        """Admit from the front, stepping over the requests in ``passed`` (ids) and whatever
        of a worse priority than one of them queued behind it; the first one that does not
        fit stops the rest."""
        admitted: list[Sequence] = []
        tokens, i = used, 0
        floor: int | None = None  # the best priority passed over so far
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if id(seq) in passed:
                floor = seq.priority if floor is None else min(floor, seq.priority)
            if id(seq) in passed or (floor is not None and seq.priority > floor):
                i += 1
                continue
            cost = min(seq.prompt_len, self.max_num_batched_tokens)
            if (admitted or used) and tokens + cost > self.max_num_batched_tokens:
                break
            if self.blocks is not None and not self._reserve(seq):
                break
            del self.waiting[i]
            tokens += cost
            self._start(seq)
            admitted.append(seq)
        return admitted

    def _passed_over(self) -> set[int]:
        """Ids of the waiting media prompts this step steps over: those with a text prompt of
        the same or a better priority waiting too. A media prompt is passed over at most
        ``MEDIA_DEFERRALS`` times, and one recomputed after a preemption never."""
        best = min((s.priority for s in self.waiting if not s.media), default=None)
        if best is None:
            return set()
        return {
            id(s)
            for s in self.waiting
            if s.media and best <= s.priority and not s.preempted and s.deferred < MEDIA_DEFERRALS
        }

    def _reserve(self, seq: Sequence) -> bool:
        """Give ``seq`` the blocks it needs (its cached prefix shared, the rest allocated) if
        they are available with headroom: one block per running row, for its next decode
        tokens (admitting into the last free blocks would only preempt someone next step)."""
        assert self.blocks is not None
        hit = self._prefix_hit(seq)
        need = self.blocks.blocks_for(seq.kv_need) - len(hit) + len(self.running)
        if need > self.blocks.available - self.blocks.idle_among(hit):
            return False
        self.blocks.share(seq.block_table, hit)
        self.blocks.allocate(seq.block_table, seq.kv_need)
        seq.cached = len(hit) * self.blocks.block_size
        if self.blocks.prefix_caching and not seq.output_ids:
            self.prefix_queried += seq.prompt_len
            self.prefix_hits += seq.cached
        return True

    def _prefix_hit(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq``'s prompt starts with, leaving at least one prompt token
        to compute (its logits give the first token). A row recomputed after a preemption
        takes none: its prompt is prefilled whole, so its output stays exactly the
        uninterrupted run's."""
        seq.cached = 0
        blocks = self.blocks
        if blocks is None or not blocks.prefix_caching or self.prefix_hasher is None:
            return []
        if seq.output_ids:
            return []
        if seq.block_hashes is None:
            seq.block_hashes = self.prefix_hasher(seq)
        usable = (seq.prompt_len - 1) // blocks.block_size
        return blocks.lookup(seq.block_hashes[:usable])

    def continuing(self, chunk: int) -> tuple[list[Sequence], int]:
        """Running rows in the middle of a chunked prefill whose next chunks (of at most
        ``chunk`` tokens) fit one step's ``max_num_batched_tokens``, the oldest first (at
        least one), and their tokens."""
        rows: list[Sequence] = []
        used = 0
        for seq in sorted(self.running, key=lambda s: s.admitted):
            if seq.chunk_row is None:
                continue
            cost = min(chunk, seq.prompt_len - seq.prefilled)
            if rows and used + cost > self.max_num_batched_tokens:
                break
            rows.append(seq)
            used += cost
        return rows, used

    def fork(self, seq: Sequence, tokens: int) -> bool:
        """Start ``seq`` (another choice of a request just prefilled) with blocks for
        ``tokens`` (its prompt, copied from its head), under the same bounds as an
        admission; False when a row or its blocks are not free now."""
        if len(self.running) >= self.max_num_seqs:
            return False
        if self.blocks is not None:
            if self.blocks.blocks_for(tokens) + len(self.running) > self.blocks.available:
                return False
            self.blocks.allocate(seq.block_table, tokens)
        self._start(seq)
        return True

    def _start(self, seq: Sequence) -> None:
        seq.slot = len(self.running)
        seq.status = SeqStatus.RUNNING
        seq.admitted, self._admissions = self._admissions, self._admissions + 1
        self.running.append(seq)

    def reserve_decode(self) -> list[Sequence]:
        """Make room for every running row's next token, preempting the newest rows while
        blocks run short (possibly the row itself). Returns the preempted rows."""
        if self.blocks is None:
            return []
        preempted: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.admitted):  # oldest first
            if seq.status is not SeqStatus.RUNNING or seq.chunk_row is not None:
                continue  # preempted for an older row just now, or still prefilling
            while not self.blocks.can_append(seq.block_table, seq.length):
                victim = max(self.running, key=lambda s: (s.priority, s.admitted))
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slot(seq.block_table, seq.length)
        return preempted

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the front of the queue (recompute)."""
        self._leave(seq)
        seq.status = SeqStatus.WAITING
        seq.slot = -1
        seq.length = 0
        seq.chunk_row, seq.prefilled = None, 0  # a chunked prefill starts over
        seq.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def remove(self, seq: Sequence) -> Sequence | None:
        """Take a running row out (its blocks are freed); the last row moves into its slot.
        Returns the moved row or None."""
        moved = self._leave(seq)
        seq.status = SeqStatus.FINISHED
        return moved

    def _leave(self, seq: Sequence) -> Sequence | None:
        if self.blocks is not None:
            self.blocks.free_table(seq.block_table)
        slot = seq.slot
        last = self.running.pop()
        if last is seq:
            return None
        self.running[slot] = last
        last.slot = slot
        return last
