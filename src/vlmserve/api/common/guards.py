"""The output guards on the wire (vLLM's request fields), checked and converted here.

- ``repetition_detection``: ``{"max_pattern_size", "min_pattern_size", "min_count"}`` as
  vLLM's ``RepetitionDetectionParams`` (``max_pattern_size`` 0 turns it off); a looping
  answer ends with ``finish_reason: "repetition"``.
- ``thinking_token_budget``: a non-negative integer, or -1 for unlimited (vLLM's); a
  thinking model's reasoning is closed after that many tokens.
- ``allowed_token_ids``: the token ids the answer may use (non-empty; ids outside the
  model's vocabulary are a 400 from the backend, which knows it).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.engine.guards import MAX_MIN_COUNT, MAX_PATTERN_SIZE, MAX_SCAN_WORK
from vlmserve.engine.types import RepetitionDetection

__all__ = ["AllowedTokenIds", "RepetitionDetectionIn", "ThinkingTokenBudget", "guard_params"]

MAX_ALLOWED_IDS = 1 << 18  # more ids than any vocabulary has

# strict: true, 8.0 and "8" are refused, as vLLM refuses bools and floats
ThinkingTokenBudget = Annotated[int | None, Field(default=None, ge=-1, strict=True)]
AllowedTokenIds = Annotated[
    list[Annotated[int, Field(ge=0, strict=True)]] | None,
    Field(default=None, min_length=1, max_length=MAX_ALLOWED_IDS),
]


class RepetitionDetectionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_pattern_size: int = Field(default=0, ge=0, le=MAX_PATTERN_SIZE, strict=True)
    min_pattern_size: int = Field(default=0, ge=0, strict=True)  # 0 counts as 1
    min_count: int = Field(default=0, ge=0, le=MAX_MIN_COUNT, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> RepetitionDetectionIn:
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "min_pattern_size must be <= max_pattern_size; set max_pattern_size to 0 to "
                "turn repetition detection off"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("min_count must be >= 2 (the copies that make a repetition)")
        work = (self.max_pattern_size - max(self.min_pattern_size, 1) + 1) * self.min_count
        if self.max_pattern_size > 0 and work > MAX_SCAN_WORK:
            raise ValueError(
                f"(max_pattern_size - min_pattern_size + 1) * min_count is {work}; the limit "
                f"is {MAX_SCAN_WORK} (narrow the pattern sizes or lower min_count)"
            )
        return self

    def to_params(self) -> RepetitionDetection | None:
        if self.max_pattern_size == 0:
            return None  # off
        return RepetitionDetection(self.max_pattern_size, self.min_pattern_size, self.min_count)


def guard_params(body: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of a chat request's guards."""
    detection = body.repetition_detection
    budget = body.thinking_token_budget
    return {
        "repetition_detection": detection.to_params() if detection is not None else None,
        "thinking_token_budget": None if budget is None or budget < 0 else budget,
        "allowed_token_ids": list(body.allowed_token_ids) if body.allowed_token_ids else None,
    }
