"""One generation on the model, run in a worker thread, streaming chunks back to the event loop."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from vlmserve.engine.hf.detok import IncrementalDetokenizer
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.stops import StopMatcher
from vlmserve.engine.types import Chunk, FinishReason, SamplingParams

__all__ = ["run_generation"]


class _Stop(StoppingCriteria):
    """Checked after every decode step: cancel requests and stop strings end generation."""

    def __init__(self, flags: Callable[[], bool]):
        self._flags = flags

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self._flags(), dtype=torch.bool)


class _Guide:
    """The response_format grammar of one generation (``Prepared.grammar`` set).

    ``generate`` calls the stopping criteria before the streamer, so the matcher follows the
    sampled tokens from ``input_ids`` itself: [1, prompt + resumed prefix + generated].
    """

    def __init__(self, grammar: Any, prefix: list[int], start: int):
        self.matcher = grammar.matcher(prefix)  # replays a resumed prefix
        self._seen = start  # input_ids positions the matcher has accepted (or that are prompt)
        self._mask: torch.Tensor | None = None  # int32 [1, ceil(V/32)], V = logits width

    def follow(self, input_ids: torch.Tensor) -> None:
        for token_id in input_ids[0, self._seen :].tolist():
            self.matcher.accept(token_id)
        self._seen = input_ids.shape[1]

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            from vlmserve.engine.hf.grammar import allocate_masks

            self._mask = allocate_masks(1, scores.shape[-1])
        self.matcher.fill_mask(self._mask, 0)
        return self._mask


class _GrammarLogits(LogitsProcessor):
    """Tokens the grammar does not allow next get -inf (before temperature/top-k/top-p)."""

    def __init__(self, guide: _Guide):
        self._guide = guide

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from vlmserve.engine.hf.grammar import apply_masks

        self._guide.follow(input_ids)
        apply_masks(scores, self._guide.mask(scores))  # scores: [1, V] float32
        return scores


class _GrammarDone(StoppingCriteria):
    """Ends generation once the JSON value and the stop token after it are accepted."""

    def __init__(self, guide: _Guide):
        self._guide = guide

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self._guide.follow(input_ids)
        done = self._guide.matcher.is_terminated()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _Sink(BaseStreamer):
    """Receives token ids from ``generate``; the first ``put`` is the prompt and is skipped."""

    def __init__(self, on_token: Callable[[int], None]):
        self._on_token = on_token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            self._on_token(int(token_id))

    def end(self) -> None:
        pass


def _generation_config(model: Any, s: SamplingParams, max_new: int, structured: bool) -> Any:
    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens = max_new
    # With a grammar the JSON value decides the length (min_tokens would ban its stop token).
    gc.min_new_tokens = None if structured else (min(s.min_tokens, max_new) or None)
    gc.do_sample = not s.greedy
    gc.temperature = s.sampling_temperature if not s.greedy else None
    gc.top_p = s.top_p if not s.greedy else None
    gc.top_k = (s.top_k or None) if not s.greedy else None
    gc.repetition_penalty = s.penalty if s.penalty != 1.0 else None
    gc.num_return_sequences = 1
    if s.ignore_eos:
        gc.eos_token_id = None
    return gc


class _Run:
    """Per-token bookkeeping of one generation: text, stops, counts, finish reason."""

    def __init__(self, prepared: Prepared, tokenizer: Any, emit: Callable[[Chunk], None]):
        req = prepared.request
        self.prepared = prepared
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(req.sampling.stop)
        for token_id in req.prefix_token_ids:  # continuing a stream: rebuild the exact state
            self.stops.feed(self.detok.push(token_id))  # (their text was sent already)
        self.emit = emit
        self.completion = len(req.prefix_token_ids)
        self.stopped = False
        self.last_token: int | None = None

    def on_token(self, token_id: int) -> None:
        if self.stopped:
            return
        self.completion += 1
        self.last_token = token_id
        text, self.stopped = self.stops.feed(self.detok.push(token_id))
        self.emit(self._chunk(text, [token_id], None))

    def finish(self, cancelled: bool, eos_ids: set[int], grammar_done: bool = False) -> None:
        tail = "" if self.stopped else self.stops.feed(self.detok.flush())[0] + self.stops.flush()
        if cancelled and not self.stopped:
            reason = FinishReason.CANCELLED
        elif self.stopped or grammar_done or (self.last_token in eos_ids and not self._ignore_eos):
            reason = FinishReason.STOP
        else:
            reason = FinishReason.LENGTH
        self.emit(self._chunk(tail, [], reason))

    @property
    def _ignore_eos(self) -> bool:
        return self.prepared.request.sampling.ignore_eos

    def _chunk(self, text: str, ids: list[int], reason: FinishReason | None) -> Chunk:
        return Chunk(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=self.prepared.prompt_tokens - len(self.prepared.request.prefix_token_ids),
            completion_tokens=self.completion,
        )


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}


def run_generation(
    model: Any,
    tokenizer: Any,
    prepared: Prepared,
    emit: Callable[[Chunk], None],
    cancel: threading.Event,
    device: torch.device,
) -> None:
    """Generate (blocking); every token is passed to ``emit`` as a Chunk, then a final Chunk."""
    req = prepared.request
    run = _Run(prepared, tokenizer, emit)
    guide = None
    if prepared.grammar is not None:
        guide = _Guide(prepared.grammar, req.prefix_token_ids, prepared.prompt_tokens)
    done = guide is not None and guide.matcher.is_terminated()  # resumed after the end
    max_new = req.sampling.max_tokens - len(req.prefix_token_ids)
    if max_new > 0 and not cancel.is_set() and not done:
        if req.sampling.seed is not None:
            torch.manual_seed(req.sampling.seed)
        inputs = {  # tensors only (the processor cache adds its keys, a list)
            k: v.to(device) for k, v in prepared.inputs.items() if isinstance(v, torch.Tensor)
        }
        stops: list[StoppingCriteria] = [_Stop(lambda: cancel.is_set() or run.stopped)]
        with torch.inference_mode():
            model.generate(
                **inputs,
                generation_config=_generation_config(
                    model, req.sampling, max_new, guide is not None
                ),
                streamer=_Sink(run.on_token),
                logits_processor=LogitsProcessorList([_GrammarLogits(guide)] if guide else []),
                stopping_criteria=StoppingCriteriaList(
                    stops + ([_GrammarDone(guide)] if guide else [])
                ),
            )
    run.finish(
        cancel.is_set(), _eos_ids(model), guide is not None and guide.matcher.is_terminated()
    )
