"""The tokenizer's ``decode`` minus transformers' per-call Python overhead.

The incremental detokeniser decodes once or twice per generated token; through
``PreTrainedTokenizerFast.decode`` each call spends ~10 µs converting arguments before the
~2 µs Rust decode. With ``clean_up_tokenization_spaces=False`` that method is exactly
``tokenizer._tokenizer.decode(ids, skip_special_tokens=...)``, so the engine calls it directly
(for tokenizers whose ``_decode`` is transformers' own; anything else is used as is).
"""

from __future__ import annotations

from typing import Any

__all__ = ["fast_decoder"]


class _RustDecode:
    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._rust = tokenizer._tokenizer

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        if clean_up_tokenization_spaces is not False:
            return self._tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            )
        return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def fast_decoder(tokenizer: Any) -> Any:
    """An object with the tokenizer's ``decode`` (and everything else) — faster when safe."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer
    if not isinstance(tokenizer, TokenizersBackend) or not hasattr(tokenizer, "_tokenizer"):
        return tokenizer
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return tokenizer  # a subclass decodes its own way
    return _RustDecode(tokenizer)
