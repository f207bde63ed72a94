"""Incremental detokenisation whose pieces concatenate to ``decode`` of all the ids.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence, and one token can even
hold the end of one character and the start of the next; decoding such a prefix gives a
trailing U+FFFD that the next token may turn into a real character. We decode a window of
recent tokens (left context matters: spaces depend on the previous token), emit the text
past what was already emitted, and hold back the trailing U+FFFD characters that a later
byte could still complete. Only the end of a decoded byte string is unsettled: appending
bytes never changes the text decoded before the last incomplete character, so everything
emitted stays a prefix of the final ``decode``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

# A UTF-8 character is at most 4 byte-tokens. Within 4 tokens of the last character boundary
# every trailing U+FFFD is held (a byte-fallback decoder shows a whole run of byte tokens as
# U+FFFD until its last character completes). Past that the text is invalid bytes (a broken
# model) and comes out, but for the last U+FFFD: a lossy byte-level decoder shows an
# incomplete character as one, which the next token may complete.
_MAX_CHAR_TOKENS = 4
_MAX_UNSETTLED = 1
# The window is cut back to the latest character boundary (a token count after which nothing
# was held) once it is longer than this: each decode stays short, and it starts where the
# text is whole (a byte-fallback tokenizer reads a run of byte tokens as one unit).
_SLIDE_AT = 6
# While the tail stays unsettled there is no boundary; past this many tokens the window is
# cut to the last _WIDE_WINDOW tokens if the held tail decodes the same there.
_MAX_WINDOW = 64
_WIDE_WINDOW = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window is self._ids[self._prefix_offset :]
        self._emitted = 0  # characters of the window's text already returned
        self._boundary = 0  # the latest token count at which nothing was held

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it settles (possibly empty)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        young = len(self._ids) - self._boundary < _MAX_CHAR_TOKENS
        settled = len(text) - _unsettled(text, len(text) if young else _MAX_UNSETTLED)
        new_text = text[self._emitted : settled] if settled > self._emitted else ""
        self._emitted = max(self._emitted, settled)
        size = len(self._ids) - self._prefix_offset
        if settled == len(text):  # a character boundary
            if size > _SLIDE_AT and self._boundary > self._prefix_offset:
                self._rebase(self._boundary, "")  # the last token(s) stay as left context
            self._boundary = len(self._ids)
        elif size > _MAX_WINDOW:
            self._rebase(len(self._ids) - _WIDE_WINDOW, text[self._emitted :])
        return new_text

    def flush(self) -> str:
        """Text still held back at the end of generation (a dangling partial character)."""
        text = self._decode(self._ids[self._prefix_offset :])
        tail = text[self._emitted :]
        self._emitted = len(text)
        return tail

    def _rebase(self, start: int, held: str) -> None:
        """Start the window at token ``start``, re-counting what was emitted from its end."""
        window = self._decode(self._ids[start:])
        if len(window) < len(held) or not window.endswith(held):
            return  # the held tail reads differently without the left context: keep it
        self._prefix_offset = start
        self._emitted = len(window) - len(held)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _unsettled(text: str, most: int) -> int:
    """How many trailing characters a later token could still change (U+FFFD, at most
    ``most``)."""
    n = 0
    while n < most and n < len(text) and text[-1 - n] == "\ufffd":
        n += 1
    return n
