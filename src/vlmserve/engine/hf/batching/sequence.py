"""One request's row in the running batch: its tokens, its sampling, where it streams."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmserve.engine.hf.inputs import Prepared

__all__ = ["SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV blocks were freed)
    RUNNING = "running"  # prefilled: owns KV blocks and a row of the batch, decodes every step
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Engine-thread state of one request. ``cancelled`` is the only field another thread
    writes (a bool store: atomic under the GIL); the engine reads it at step boundaries."""

    prepared: Prepared
    loop: Any  # the consumer's event loop (asyncio.AbstractEventLoop)
    queue: Any  # its asyncio.Queue: Chunks, then an exception or END
    max_new: int  # tokens this run may still produce (max_tokens minus a resumed prefix)
    run: Any = None  # generation._Run: detokeniser, stop strings, counts, finish reason
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

    @property
    def prompt_len(self) -> int:
        return self.prepared.prompt_tokens

    def start_sampling(self, vocab: int, device: torch.device) -> None:
        """Per-row sampling state: seeded RNG, penalty mask, grammar matcher (with a resumed
        prefix replayed). Once per request: a preempted row keeps its state."""
        req = self.prepared.request
        if req.sampling.seed is not None and not req.sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(req.sampling.seed)
        if req.sampling.penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[self.prepared.inputs["input_ids"][0].to(device)] = True
        if self.prepared.grammar is not None:
            self.matcher = self.prepared.grammar.matcher(prefix=req.prefix_token_ids)

    @property
    def kv_need(self) -> int:
        """Tokens whose K/V admission must make room for: the prompt, plus the tokens it
        generated before a preemption (recomputed)."""
        return self.prompt_len + len(self.output_ids)

    @property
    def sampling(self) -> Any:
        return self.prepared.request.sampling
