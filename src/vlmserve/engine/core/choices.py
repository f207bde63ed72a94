"""The ``n`` choices of one request on the batched engine: one prefill, then forks.

Choice 0 (the *head*) is the sequence the consumer holds; choices 1..n-1 ride on it
(``Sequence.pending``) until its prompt is prefilled. Then each takes a copy of the head's
prompt KV blocks (``KVPaging.copy_prompt``) and samples its first token from the head's
prompt logits with its own state: RNG seeded with ``seed + index``, penalties, grammar. From
there it is an ordinary row (decoded, preempted and recomputed like any other). A choice
for which no row or no KV blocks are free at that moment queues as a request of its own
and prefills its prompt when admitted: forking never waits and never deadlocks.
All choices share the consumer's queue; ``END`` goes out once the last one ended
(``Group``).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.core.sequence import Sequence

__all__ = ["fork"]


def fork(
    scheduler: Any, paging: Any, sampler: Any, heads: list[Sequence], logits: torch.Tensor
) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, BaseException]]]:
    """Fork the pending choices of ``heads`` (just prefilled; ``logits``: [h, V], their
    prompt logits, unmodified). Returns (forked choices with their first tokens, choices
    that failed to sample: their grammar refused, ...)."""
    rows: list[int] = []
    forked: list[Sequence] = []
    failed: list[tuple[Sequence, BaseException]] = []
    for h, head in enumerate(heads):
        for seq in head.pending:
            if not scheduler.fork(seq, head.prompt_len):  # no room now: prefilled on its
                scheduler.waiting.appendleft(seq)  # own when admitted
                continue
            try:
                paging.copy_prompt(head, seq)
                seq.rope_delta = head.rope_delta  # M-RoPE: the same prompt, the same positions
                seq.start_sampling(sampler.vocab_size, paging.runner.device)
            except Exception as exc:  # this choice fails alone (it is running: the engine
                failed.append((seq, exc))  # removes it)
                continue
            rows.append(h)
            forked.append(seq)
        head.pending = []
    if not forked:
        return [], failed
    try:
        tokens = sampler.sample(logits[rows], forked)
    except Exception as exc:  # fail those choices only
        return [], failed + [(seq, exc) for seq in forked]
    for seq in forked:
        paging.after_prefill(seq)
    return list(zip(forked, tokens, strict=True)), failed
