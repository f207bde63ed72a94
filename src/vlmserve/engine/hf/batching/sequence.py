"""One request's row in the running batch: its tokens, its sampling, where it streams."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.engine.hf.inputs import Prepared

__all__ = ["SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; nothing computed yet
    RUNNING = "running"  # prefilled: owns a KV slot, decodes every step
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
    slot: int = -1  # row of the KV cache (and of the decode batch)
    length: int = 0  # tokens whose K/V are in the cache
    rope_delta: int = 0  # M-RoPE: position of cache index i is i + rope_delta
    generated: int = 0  # tokens sampled in this run
    next_token: int = -1  # sampled, not yet fed through the model
    finished_step: int = -1  # engine step at which the row left (tests, diagnostics)
    grammar_done: bool = False  # the response-format grammar is complete: finish with "stop"
    generator: torch.Generator | None = None  # per-row RNG when the request has a seed
    matcher: Any = None  # grammar matcher (engine.hf.grammar) or None
    seen: torch.Tensor | None = None  # [V] bool: tokens in prompt + output (repetition penalty)

    @property
    def prompt_len(self) -> int:
        return self.prepared.prompt_tokens

    @property
    def sampling(self) -> Any:
        return self.prepared.request.sampling
