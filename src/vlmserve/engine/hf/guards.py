"""The output guards on the ``model.generate`` path (one request at a time), as
transformers logits processors and stopping criteria; the batched engine applies the same
rules in its sampler (``engine/core/sampler.py``) and step (``engine/guards.py``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

from vlmserve.engine.guards import ThinkingBudget, looping, thinking_budget
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.tracker import OutputTracker

__all__ = ["guards"]


class _Allowed(LogitsProcessor):
    """``allowed_token_ids``: every other token gets -inf (scores: [1, V])."""

    def __init__(self, ids: list[int]):
        self._ids = sorted(set(ids))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[:, torch.tensor(self._ids, device=scores.device)] = True
        return scores.masked_fill(~keep, -torch.inf)


class _Budget(LogitsProcessor):
    """``thinking_token_budget``: reads the tokens sampled since its last call, then forces
    the next end-tag token once the budget is spent (runs last: it must win)."""

    def __init__(self, state: ThinkingBudget, start: int):
        self._state, self._seen = state, start  # input_ids positions already observed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self._seen :].tolist():
            self._state.observe(token)
        self._seen = input_ids.shape[1]
        token = self._state.forced()
        if token is None:
            return scores
        forced = torch.full_like(scores, -torch.inf)
        forced[:, token] = 0.0
        return forced


class _Repetition(StoppingCriteria):
    """``repetition_detection``: ends generation when the output starts looping; the
    tracker then finishes with ``repetition`` (EOS, stop strings, max_tokens win)."""

    def __init__(self, prepared: Prepared, run: OutputTracker, start: int):
        self._request, self._run, self._start = prepared.request, run, start

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        output = input_ids[0, self._start :].tolist()  # resumed prefix included
        self._run.repeated = looping(self._request.sampling, output)
        return torch.full((input_ids.shape[0],), self._run.repeated, device=input_ids.device)


def guards(
    prepared: Prepared, tokenizer: Any, run: OutputTracker
) -> tuple[list[LogitsProcessor], list[StoppingCriteria]]:
    """The processors (to run after the others) and stopping criteria of a request's
    guards; ``input_ids`` hold the prompt, then the resumed prefix, then new tokens."""
    sampling = prepared.request.sampling
    prompt_end = prepared.prompt_tokens
    output_start = prompt_end - len(prepared.request.prefix_token_ids)
    processors: list[LogitsProcessor] = []
    if sampling.allowed_token_ids:
        processors.append(_Allowed(sampling.allowed_token_ids))
    budget = thinking_budget(prepared, tokenizer)
    if budget is not None:
        processors.append(_Budget(budget, prompt_end))
    stops: list[StoppingCriteria] = []
    if sampling.repetition_detection is not None:
        stops.append(_Repetition(prepared, run, output_start))
    return processors, stops
