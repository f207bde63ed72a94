"""Sampled tokens' log-probabilities in OpenAI's shape (``choices[].logprobs.content[]``).

Each item is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}``. ``token`` is the token decoded alone (special tokens included), ``bytes`` its
UTF-8 bytes, as vLLM returns them; a byte-level token that is only part of a character
decodes to U+FFFD there, the text of the answer is unaffected.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TokenTexts"]

_CACHE_LIMIT = 65_536  # token strings kept per request (a vocabulary's worth at most)


class TokenTexts:
    """Token id -> its text, cached (the top alternatives repeat from step to step)."""

    __slots__ = ("_cache", "_tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            if len(self._cache) < _CACHE_LIMIT:
                self._cache[token_id] = hit
        return hit

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def item(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        """The ``logprobs.content`` item of one sampled token and its best alternatives."""
        out = self.entry(token_id, logprob)
        out["top_logprobs"] = [self.entry(i, lp) for i, lp in top]
        return out


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token of probability 0 (masked) gets float32's lowest value,
    as vLLM's -9999.0 stands in for it."""
    return logprob if math.isfinite(logprob) else -9999.0
