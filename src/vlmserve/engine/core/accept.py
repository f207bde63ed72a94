"""A sampled token taken into its row: what every consumer of the row's tokens is told."""

from __future__ import annotations

from vlmserve.engine.core.sequence import Sequence
from vlmserve.engine.guards import looping

__all__ = ["accept"]


def accept(seq: Sequence, token: int, vocab: int, eos_ids: set[int]) -> bool:
    """Record ``token`` as ``seq``'s next: its output, grammar, penalty counts, thinking
    budget and stream; True when the row is done (a stop string, a complete grammar, EOS,
    max_tokens or a repetition)."""
    if not 0 <= token < vocab:  # never embed an id the model does not have
        raise IndexError(f"sampled token {token} is outside the vocabulary ({vocab})")
    seq.generated += 1
    seq.output_ids.append(token)
    seq.next_token = token
    if seq.matcher is not None:
        seq.matcher.accept(token)
        seq.grammar_done = seq.matcher.is_terminated()
    elif seq.end_of_thinking():  # the answer starts: from now on it follows the grammar
        seq.matcher = seq.prepared.grammar.matcher()
    if seq.seen is not None:
        seq.seen[token] = True
    if seq.counts is not None:
        seq.counts[token] += 1
    if seq.budget is not None:
        seq.budget.observe(token)
    seq.run.on_token(token, seq.step_logprobs)
    seq.step_logprobs = None
    eos = token in eos_ids and not seq.sampling.ignore_eos
    if seq.run.stopped or seq.grammar_done or eos or seq.generated >= seq.max_new:
        return True
    seq.run.repeated = looping(seq.sampling, seq.output_ids, seq.prepared.request.prefix_token_ids)
    return seq.run.repeated
