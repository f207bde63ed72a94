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

from vlmserve.engine.hf.guards import guards
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.tracker import OutputTracker
from vlmserve.engine.types import Chunk, SamplingParams
from vlmserve.errors import UnsupportedFeature

__all__ = ["eos_ids", "run_generation", "tokens_after"]


class _Stop(StoppingCriteria):
    """Checked after every decode step: cancel requests and stop strings end generation."""

    def __init__(self, flags: Callable[[], bool]):
        self._flags = flags

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self._flags(), dtype=torch.bool)


class _Guide:
    """The response_format grammar of one generation (``Prepared.grammar`` set).

    ``generate`` calls the stopping criteria before the streamer, so the matcher follows the
    sampled tokens from ``input_ids`` itself: [1, prompt + resumed prefix + generated]. For
    a thinking model whose prompt opened the reasoning (``think_end``: the ids of
    ``</think>``) the grammar starts after that tag; until then nothing is masked.
    """

    def __init__(self, grammar: Any, prefix: list[int], start: int, think_end: list[int] | None):
        self._grammar, self._end = grammar, think_end
        self._seen = start  # input_ids positions the guide has read (or that are prompt)
        self._tail: list[int] = list(prefix)  # tokens read while reasoning (end-tag search)
        self._mask: torch.Tensor | None = None  # int32 [1, ceil(V/32)], V = logits width
        answer = tokens_after(prefix, think_end)
        self.matcher: Any = grammar.matcher(answer) if answer is not None else None

    def follow(self, input_ids: torch.Tensor) -> None:
        for token_id in input_ids[0, self._seen :].tolist():
            if self.matcher is not None:
                self.matcher.accept(token_id)
                continue
            self._tail.append(token_id)
            if self._end is not None and self._tail[-len(self._end) :] == self._end:
                self.matcher = self._grammar.matcher()  # the answer starts now
        self._seen = input_ids.shape[1]

    @property
    def done(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            from vlmserve.engine.hf.grammar import allocate_masks

            self._mask = allocate_masks(1, scores.shape[-1])
        self.matcher.fill_mask(self._mask, 0)
        return self._mask


def tokens_after(tokens: list[int], end: list[int] | None) -> list[int] | None:
    """The tokens after the first ``end`` (all when ``end`` is None); None if not there:
    the answer part of a thinking model's output (``end``: the ids of ``</think>``)."""
    if end is None:
        return tokens
    for stop in range(len(end), len(tokens) + 1):
        if tokens[stop - len(end) : stop] == end:
            return tokens[stop:]
    return None


class _GrammarLogits(LogitsProcessor):
    """Tokens the grammar does not allow next get -inf (before temperature/top-k/top-p)."""

    def __init__(self, guide: _Guide):
        self._guide = guide

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from vlmserve.engine.hf.grammar import apply_masks

        self._guide.follow(input_ids)
        if self._guide.matcher is not None:  # None: still reasoning
            apply_masks(scores, self._guide.mask(scores))  # scores: [1, V] float32
        return scores


class _GrammarDone(StoppingCriteria):
    """Ends generation once the JSON value and the stop token after it are accepted."""

    def __init__(self, guide: _Guide):
        self._guide = guide

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self._guide.follow(input_ids)
        done = self._guide.done
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _Penalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens (``input_ids`` from
    ``start`` on: a resumed prefix counts as generated): logits[j] -= frequency * count[j]
    + presence * (count[j] > 0). Runs after transformers' own penalties, before temperature."""

    def __init__(self, sampling: SamplingParams, start: int):
        self._presence, self._frequency = sampling.presence_penalty, sampling.frequency_penalty
        self._start = start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        counts = torch.bincount(input_ids[0, self._start :], minlength=vocab)[:vocab]
        counts = counts.to(scores.dtype)  # [V]
        return scores - (counts * self._frequency + (counts > 0) * self._presence)


class _LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: each listed token's bias added to its logit (before temperature)."""

    def __init__(self, bias: dict[int, float]):
        self._ids, self._values = list(bias), list(bias.values())

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids = torch.tensor(self._ids, dtype=torch.long, device=scores.device)
        values = torch.tensor(self._values, dtype=scores.dtype, device=scores.device)
        return scores.index_add(1, ids, values.expand(scores.shape[0], -1))


class _RawLogprobs:
    """The model's raw next-token log-probabilities, caught at the output layer (before any
    logits processor), for the token the streamer receives next: [V] float32 per step."""

    def __init__(self, model: Any, top: int):
        self._top = top
        self._last: torch.Tensor | None = None
        head = model.get_output_embeddings()
        if head is None:
            raise UnsupportedFeature(
                f"logprobs: {type(model).__name__} has no output layer to read them from",
                param="logprobs",
            )
        self._handle = head.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: torch.Tensor) -> None:
        self._last = output[0, -1].float().log_softmax(dim=-1)  # output: [1, L, V]

    def of(self, token_id: int) -> tuple[float, list[tuple[int, float]]] | None:
        if self._last is None:
            return None
        top_v, top_i = self._last.topk(min(self._top, self._last.shape[0]))
        return float(self._last[token_id]), list(zip(top_i.tolist(), top_v.tolist(), strict=True))

    def close(self) -> None:
        self._handle.remove()


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


def eos_ids(model: Any) -> set[int]:
    """The token ids that end a generation (the checkpoint's generation config)."""
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
    """Generate (blocking); every token is passed to ``emit`` as a Chunk, then a final Chunk
    per choice. ``n`` > 1: the choices one after the other, choice i seeded with seed + i."""
    for index in range(prepared.request.sampling.n):
        _generate_one(model, tokenizer, prepared, emit, cancel, device, index)


def _generate_one(
    model: Any,
    tokenizer: Any,
    prepared: Prepared,
    emit: Callable[[Chunk], None],
    cancel: threading.Event,
    device: torch.device,
    index: int,
) -> None:
    req = prepared.request
    run = OutputTracker(prepared, tokenizer, emit, index)
    guide = None
    if prepared.grammar is not None:
        end = getattr(prepared.parsers, "reasoning_end", None)
        think_end = tokenizer.encode(end, add_special_tokens=False) if end else None
        guide = _Guide(prepared.grammar, req.prefix_token_ids, prepared.prompt_tokens, think_end)
    max_new = req.sampling.max_tokens - len(req.prefix_token_ids)
    if max_new > 0 and not cancel.is_set() and not (guide is not None and guide.done):
        seed = req.sampling.choice_seed(index)
        if seed is not None:
            torch.manual_seed(seed)
        extra = guards(prepared, tokenizer, run)
        _generate(model, prepared, run, guide, cancel, device, max_new, extra)
    run.finish(cancel.is_set(), eos_ids(model), guide is not None and guide.done)


def _generate(
    model: Any,
    prepared: Prepared,
    run: OutputTracker,
    guide: _Guide | None,
    cancel: threading.Event,
    device: torch.device,
    max_new: int,
    extra: tuple[list[LogitsProcessor], list[StoppingCriteria]],
) -> None:
    """``extra``: the output guards' processors (run last) and stopping criteria."""
    req = prepared.request
    inputs = {  # tensors only (the processor cache adds its keys, a list)
        k: v.to(device) for k, v in prepared.inputs.items() if isinstance(v, torch.Tensor)
    }
    processors: list[LogitsProcessor] = [_GrammarLogits(guide)] if guide else []
    if req.sampling.logit_bias:
        processors.append(_LogitBias(req.sampling.logit_bias))
    if req.sampling.additive_penalties:
        start = prepared.prompt_tokens - len(req.prefix_token_ids)
        processors.append(_Penalties(req.sampling, start))
    processors += extra[0]
    stops: list[StoppingCriteria] = [_Stop(lambda: cancel.is_set() or run.stopped), *extra[1]]
    catch = _RawLogprobs(model, req.sampling.top_logprobs) if req.sampling.logprobs else None
    on_token = run.on_token if catch is None else lambda t: run.on_token(t, catch.of(t))
    try:
        with torch.inference_mode():
            model.generate(
                **inputs,
                generation_config=_generation_config(
                    model, req.sampling, max_new, guide is not None
                ),
                streamer=_Sink(on_token),
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList(
                    stops + ([_GrammarDone(guide)] if guide else [])
                ),
            )
    finally:
        if catch is not None:
            catch.close()
