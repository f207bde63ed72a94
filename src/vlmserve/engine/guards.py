"""Output guards that watch the tokens as they come (pure Python, shared by both paths).

- ``repeats(tokens, params)``: vLLM's ``repetition_detection`` check, run after every token:
  does the output end with a pattern of ``min_pattern_size``..``max_pattern_size`` tokens
  repeated ``min_count`` times back to back? The engine then finishes the row with finish
  reason ``repetition`` (vLLM's ``FinishReason.REPETITION``), unless an EOS, a stop string or
  ``max_tokens`` ended it on the same token (those win, as in vLLM's ``check_stop``), and
  never before ``min_tokens``.
- ``ThinkingBudget``: vLLM's ``thinking_token_budget``. It counts the tokens a thinking model
  generates inside its reasoning; once ``budget`` of them are out, the next tokens are
  forced to the reasoning's end tag (``</think>``, token by token), and the model answers
  after it as if it had stopped thinking by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmserve.engine.parsers.reasoning import Phase
from vlmserve.engine.types import RepetitionDetection

__all__ = [
    "MAX_MIN_COUNT",
    "MAX_PATTERN_SIZE",
    "MAX_SCAN_WORK",
    "ThinkingBudget",
    "looping",
    "repeats",
    "thinking_budget",
]

# Limits on a request's detector, so that one check costs at most MAX_SCAN_WORK compares
MAX_PATTERN_SIZE = 2048
MAX_MIN_COUNT = 1024
MAX_SCAN_WORK = MAX_PATTERN_SIZE * 10  # (max_pattern_size - min_pattern_size + 1) * min_count


def repeats(tokens: Sequence[int], params: RepetitionDetection) -> bool:
    """Whether ``tokens`` end with a pattern repeated ``min_count`` times in a row.

    Pattern lengths are tried from the shortest; each try compares the last ``length``
    tokens with the ``min_count - 1`` copies before them and stops at the first difference,
    so a non-repeating tail costs about one compare per length.
    """
    low, high, count = max(params.min_pattern_size, 1), params.max_pattern_size, params.min_count
    if high <= 0 or count < 2 or low > high or high > MAX_PATTERN_SIZE:
        return False
    if (high - low + 1) * count > MAX_SCAN_WORK:
        return False
    for length in range(low, high + 1):
        if length * count > len(tokens):
            return False
        if _repeated(tokens, length, count):
            return True
    return False


def looping(sampling: Any, output: list[int], prefix: Sequence[int] = ()) -> bool:
    """Whether an output (``prefix``: a resumed stream's tokens, then ``output``) has just
    started looping: its request's detector fires, and ``min_tokens`` are out."""
    params = sampling.repetition_detection
    if params is None or len(prefix) + len(output) < sampling.min_tokens:
        return False
    window = params.max_pattern_size * params.min_count
    tokens = output if len(output) >= window or not prefix else [*prefix, *output]
    return repeats(tokens, params)


def _repeated(tokens: Sequence[int], length: int, count: int) -> bool:
    for back in range(1, length + 1):
        token = tokens[-back]
        for copy in range(1, count):
            if tokens[-(length * copy + back)] != token:
                return False
    return True


@dataclass(slots=True)
class ThinkingBudget:
    """One output's reasoning budget. ``observe`` every token the output takes (a resumed
    prefix's too); ``forced()`` is the token the next step must take, or None."""

    budget: int
    end: list[int]  # token ids of the tag that ends the reasoning
    start: list[int] = field(default_factory=list)  # ... that opens it (model-written)
    thinking: bool = False  # inside the reasoning now
    count: int = 0  # reasoning tokens the model chose
    closing: int = 0  # end-tag tokens forced so far
    _tail: list[int] = field(default_factory=list)

    def forced(self) -> int | None:
        if self.thinking and self.count >= self.budget and self.closing < len(self.end):
            return self.end[self.closing]
        return None

    def observe(self, token: int) -> None:
        self._tail = [*self._tail, token][-max(len(self.end), len(self.start), 1) :]
        if not self.thinking:
            if self.start and self._tail[-len(self.start) :] == self.start:
                self.thinking, self.count, self.closing = True, 0, 0
            return
        if self.count >= self.budget:
            self.closing += 1  # this token was forced
        else:
            self.count += 1
        if self._tail[-len(self.end) :] == self.end:
            self.thinking = False


def thinking_budget(prepared: Any, tokenizer: Any) -> ThinkingBudget | None:
    """The budget of a request with ``thinking_token_budget`` on a thinking model (a
    reasoning parser reads its output), its resumed prefix replayed; None otherwise (a
    model without reasoning has nothing to cut)."""
    request = prepared.request
    budget = request.sampling.thinking_token_budget
    stream = getattr(prepared.parsers, "reasoning", None)
    if budget is None or stream is None or stream.first is Phase.AFTER:
        return None  # no reasoning, or the prompt closed it (``enable_thinking: false``)

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    state = ThinkingBudget(budget, ids(stream.end_tag), ids(stream.start_tag))
    state.thinking = stream.first is Phase.REASONING
    for token in request.prefix_token_ids:
        state.observe(token)
    return state
