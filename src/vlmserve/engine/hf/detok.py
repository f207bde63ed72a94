"""Incremental detokenisation that never splits a multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence; decoding them alone
gives U+FFFD. We decode a short window of already-read tokens plus the new ones and emit
only the text past the window, holding back while the tail is an incomplete character
(the same scheme as vLLM's and TGI's ``decode_token``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

_WINDOW = 5  # tokens of left context kept for decoding (spaces depend on the previous token)
# A UTF-8 character is at most 4 bytes, so at most 4 byte-tokens: past that a U+FFFD is real
# (a random or broken model emitting invalid bytes) and is emitted rather than held forever.
_MAX_CHAR_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        waiting = len(self._ids) - self._read_offset
        if full.endswith("\ufffd") and waiting < _MAX_CHAR_TOKENS:
            return ""  # an incomplete character: wait for its next byte-token
        new_text = full[len(prefix) :] if len(full) > len(prefix) else ""
        if new_text or waiting >= _MAX_CHAR_TOKENS:
            self._prefix_offset = max(self._read_offset, len(self._ids) - _WINDOW)
            self._read_offset = len(self._ids)
        return new_text

    def flush(self) -> str:
        """Text still held back at the end of generation (a dangling partial character)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
