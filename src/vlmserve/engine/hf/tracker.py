"""What a generation sends back, token by token: ``OutputTracker``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmserve.engine.hf.detok import IncrementalDetokenizer
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.logprobs import TokenTexts
from vlmserve.engine.hf.stops import StopMatcher
from vlmserve.engine.types import Chunk, FinishReason

__all__ = ["OutputTracker"]


class OutputTracker:
    """Per-token bookkeeping of one generation (one choice): incremental text, stop strings,
    counts, the finish reason, and the OpenAI logprobs items of each token when asked for.
    The batched engine (one per row) and the ``model.generate`` fallback both use it, so a
    request's chunks are the same whichever path serves it."""

    def __init__(
        self, prepared: Prepared, tokenizer: Any, emit: Callable[[Chunk], None], index: int = 0
    ) -> None:
        req = prepared.request
        self.prepared = prepared
        self.index = index
        self.tokens = TokenTexts(tokenizer) if req.sampling.logprobs else None
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(req.sampling.stop)
        for token_id in req.prefix_token_ids:  # continuing a stream: rebuild the exact state
            self.stops.feed(self.detok.push(token_id))  # (their text was sent already)
        self.emit = emit
        self.completion = len(req.prefix_token_ids)
        self.stopped = False
        self.repeated = False  # repetition_detection found a loop (``engine/guards.py``)
        self.last_token: int | None = None
        self.cached_tokens: int | None = None  # set by an engine that caches prefixes

    def on_token(self, token_id: int, logprobs: Any = None) -> None:
        """``logprobs``: the sampler's (logprob, [(id, logprob)] best first) for this token."""
        if self.stopped:
            return
        self.completion += 1
        self.last_token = token_id
        text, self.stopped = self.stops.feed(self.detok.push(token_id))
        chunk = self._chunk(text, [token_id], None)
        if self.tokens is not None and logprobs is not None:
            chunk.logprobs = [self.tokens.item(token_id, *logprobs)]
        self.emit(chunk)

    def finish(self, cancelled: bool, eos_ids: set[int], grammar_done: bool = False) -> None:
        tail = "" if self.stopped else self.stops.feed(self.detok.flush())[0] + self.stops.flush()
        if cancelled and not self.stopped:
            reason = FinishReason.CANCELLED
        elif self.stopped or grammar_done or (self.last_token in eos_ids and not self._ignore_eos):
            reason = FinishReason.STOP
        elif self.repeated and self.completion < self.prepared.request.sampling.max_tokens:
            reason = FinishReason.REPETITION  # max_tokens reached on the same token wins
        else:
            reason = FinishReason.LENGTH
        self.emit(self._chunk(tail, [], reason))
        self.release()

    def release(self) -> None:
        """No more chunks: drop ``emit``. The batched engine's emit closes over the row, which
        holds this tracker: a cycle that only the cyclic GC would free, keeping the request's
        decoded media and pixel tensors alive long after the answer (in the API process with
        --no-engine-process)."""
        self.emit = _ended

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
            logprobs=[] if self.tokens is not None else None,
            index=self.index,
            cached_tokens=self.cached_tokens,
        )


def _ended(chunk: Chunk) -> None:
    """The emit of a finished tracker: its chunks were all sent."""
