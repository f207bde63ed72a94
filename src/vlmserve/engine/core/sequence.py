"""One request's row in the running batch: its tokens, its sampling, where it streams."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmserve.engine.hf.generation import tokens_after
from vlmserve.engine.hf.inputs import Prepared

__all__ = ["Group", "SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV blocks were freed)
    RUNNING = "running"  # prefilled: owns KV blocks and a row of the batch, decodes every step
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Group:
    """The ``n`` choices of one request: they share its consumer's queue, and the queue
    gets ``END`` once, when the last of them has left."""

    head: Sequence  # choice 0: the sequence the consumer holds (and cancels)
    left: int  # choices that have not ended yet


@dataclass(slots=True, eq=False)
class Sequence:
    """Engine-thread state of one request. ``cancelled`` is the only field another thread
    writes (a bool store: atomic under the GIL); the engine reads it at step boundaries."""

    prepared: Prepared
    loop: Any  # the consumer's event loop (asyncio.AbstractEventLoop)
    queue: Any  # its asyncio.Queue: Chunks, then an exception or END
    max_new: int  # tokens this run may still produce (max_tokens minus a resumed prefix)
    run: Any = None  # hf.tracker.OutputTracker: detokeniser, stop strings, counts, finish reason
    status: SeqStatus = SeqStatus.WAITING
    cancelled: bool = False
    slot: int = -1  # row of the decode batch (running rows are 0..B-1)
    block_table: list[int] = field(default_factory=list)  # its KV blocks (BlockManager)
    admitted: int = -1  # admission order: the newest running row is preempted first
    length: int = 0  # tokens whose K/V are in the cache
    rope_delta: int = 0  # M-RoPE: position of cache index i is i + rope_delta
    generated: int = 0  # tokens sampled in this run
    output_ids: list[int] = field(default_factory=list)  # those tokens (recomputed if preempted)
    # After a preemption: tokens already sampled and streamed, fed again one decode step
    # each (logits discarded, nothing sampled or emitted) until the KV is back.
    replay: deque[int] = field(default_factory=deque)
    preempted: int = 0  # times this row lost its KV blocks
    next_token: int = -1  # sampled, not yet fed through the model
    finished_step: int = -1  # engine step at which the row left (tests, diagnostics)
    grammar_done: bool = False  # the response-format grammar is complete: finish with "stop"
    generator: torch.Generator | None = None  # per-row RNG when the request has a seed
    matcher: Any = None  # grammar matcher (engine.hf.grammar) or None
    seen: torch.Tensor | None = None  # [V] bool: tokens in prompt + output (repetition penalty)
    priority: int = 0  # GenerateRequest.priority: 0 interactive, higher waits (batch work)
    overtaken: int = 0  # times a higher-priority request was queued ahead of it
    media: bool = False  # its prompt has images or video: embedding it runs the vision tower
    deferred: int = 0  # steps it waited for text prompts queued behind it (``Scheduler``)
    counts: torch.Tensor | None = None  # [V] float32: generated tokens by id (presence/frequency)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: (ids [k], values [k])
    allowed: torch.Tensor | None = None  # allowed_token_ids: [k] long, the only ids it samples
    budget: Any = None  # engine.guards.ThinkingBudget: thinking_token_budget's state
    step_logprobs: Any = None  # the sampler's (logprob, top [(id, logprob)]) of the last token
    index: int = 0  # the choice this row produces (n > 1)
    group: Group | None = None  # the request's choices, when n > 1
    # choices 1..n-1 not yet forked: they take a copy of this row's prompt KV after its prefill
    pending: list[Sequence] = field(default_factory=list)
    # a thinking model's reasoning end (token ids) while it reasons: the grammar starts
    # after it (then None)
    think_end: list[int] | None = None
    block_hashes: list[bytes] | None = None  # prefix-cache keys of its full prompt blocks
    cached: int = 0  # prompt tokens whose K/V came from the prefix cache at this admission
    # chunked prefill (a prompt longer than max_num_batched_tokens): the whole prompt's
    # PrefillRow while it is computed chunk by chunk, the tokens done, the current chunk's end
    chunk_row: Any = None
    prefilled: int = 0
    chunk_end: int = 0
    # where its time goes (time.perf_counter()): queued, first admitted, first and last token,
    # and the seconds its prompt spent embedding (vision tower included)
    queued_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    vision_s: float = 0.0

    def timings(self) -> dict[str, float]:
        """Seconds by phase (``Chunk.timings``): queue (waiting for admission), vision
        (embedding the prompt), prefill (the rest until the first token), decode (first to
        last token). They add up to the time from submission to the last token."""
        now = time.perf_counter()
        scheduled = self.scheduled_at or now
        first = self.first_at or max(self.last_at, scheduled)
        return {
            "queue": scheduled - self.queued_at,
            "vision": self.vision_s,
            "prefill": max(0.0, first - scheduled - self.vision_s),
            "decode": (self.last_at - first) if self.last_at else 0.0,
        }

    @property
    def prompt_len(self) -> int:
        return self.prepared.prompt_tokens

    def start_sampling(self, vocab: int, device: torch.device) -> None:
        """Per-row sampling state: seeded RNG, penalty mask, grammar matcher (with a resumed
        prefix replayed). Once per request: a preempted row keeps its state."""
        req = self.prepared.request
        seed = req.sampling.choice_seed(self.index)
        if seed is not None and not req.sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
            skip_draws(self.generator, len(req.prefix_token_ids), device)
        if req.sampling.penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[self.prepared.inputs["input_ids"][0].to(device)] = True
        if req.sampling.additive_penalties:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            prefix = torch.tensor(req.prefix_token_ids, dtype=torch.long, device=device)
            self.counts.index_add_(0, prefix, torch.ones_like(prefix, dtype=torch.float32))
        if req.sampling.logit_bias:
            bias = req.sampling.logit_bias
            ids = torch.tensor(list(bias), dtype=torch.long, device=device)
            self.bias = (ids, torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
        if req.sampling.allowed_token_ids:
            ids = sorted(set(req.sampling.allowed_token_ids))
            self.allowed = torch.tensor(ids, dtype=torch.long, device=device)
        if self.prepared.grammar is not None:
            answer = tokens_after(req.prefix_token_ids, self.think_end)
            if answer is not None:  # no reasoning, or it ended within the resumed prefix
                self.think_end = None
                self.matcher = self.prepared.grammar.matcher(prefix=answer)

    def end_of_thinking(self) -> bool:
        """After a token is appended: True once, when the reasoning has just ended (the
        response-format grammar starts with the next token)."""
        end = self.think_end
        if end is None or self.output_ids[-len(end) :] != end:
            return False
        self.think_end = None
        return True

    @property
    def cancelled_now(self) -> bool:
        """Cancelled itself, or its request was (the consumer holds choice 0 only)."""
        return self.cancelled or (self.group is not None and self.group.head.cancelled)

    @property
    def prefilling(self) -> bool:
        """In the middle of a chunked prefill: this forward's chunk is not its prompt's last
        (its logits give no token)."""
        return self.chunk_row is not None and self.chunk_end < self.prompt_len

    @property
    def kv_need(self) -> int:
        """Tokens whose K/V admission must make room for: the prompt, plus the tokens it
        generated before a preemption (recomputed)."""
        return self.prompt_len + len(self.output_ids)

    @property
    def sampling(self) -> Any:
        return self.prepared.request.sampling


def skip_draws(generator: torch.Generator, n: int, device: torch.device) -> None:
    """Advance a seeded row's generator past the ``n`` tokens a resumed stream already sent
    (``prefix_token_ids``): one float32 U[0, 1) each, drawn as ``Sampler._uniforms`` draws
    them, so the continuation after a restart is the one the first run sampled."""
    one = torch.empty(1, dtype=torch.float32, device=device)
    for _ in range(n):
        one.uniform_(generator=generator)
