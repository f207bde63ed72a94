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

_WINDOW = 5  # tokens of left context kept for decoding once the text is settled
_SLIDE_AT = 2 * _WINDOW  # window size that triggers a slide (not every token: one decode less)
# An incomplete UTF-8 character is at most 3 bytes: a lossy decoder shows it as one U+FFFD,
# a byte-fallback one as up to 3. More trailing U+FFFD than that are invalid bytes for good.
_MAX_UNSETTLED = 3
# While a tail stays unsettled the window grows; past this many tokens it is cut back to
# _WIDE_WINDOW tokens (if the held tail decodes the same there), keeping each decode short.
_MAX_WINDOW = 64
_WIDE_WINDOW = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window is self._ids[self._prefix_offset :]
        self._emitted = 0  # characters of the window's text already returned

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it settles (possibly empty)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        settled = len(text) - _unsettled(text)
        new_text = text[self._emitted : settled] if settled > self._emitted else ""
        self._emitted = max(self._emitted, settled)
        self._slide(text)
        return new_text

    def flush(self) -> str:
        """Text still held back at the end of generation (a dangling partial character)."""
        text = self._decode(self._ids[self._prefix_offset :])
        tail = text[self._emitted :]
        self._emitted = len(text)
        return tail

    def _slide(self, text: str) -> None:
        """Move the window's start right, re-counting what was emitted from the right end."""
        size = len(self._ids) - self._prefix_offset
        held = text[self._emitted :]
        if held:
            if size <= _MAX_WINDOW:
                return
            keep = _WIDE_WINDOW
        elif size <= _SLIDE_AT:
            return
        else:
            keep = _WINDOW
        start = len(self._ids) - keep
        window = self._decode(self._ids[start:])
        if not window.endswith(held) or len(window) < len(held):
            return  # the held tail reads differently without the left context: keep it
        self._prefix_offset = start
        self._emitted = len(window) - len(held)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _unsettled(text: str) -> int:
    """How many trailing characters a later token could still change (U+FFFD, at most 3)."""
    n = 0
    while n < _MAX_UNSETTLED and n < len(text) and text[-1 - n] == "\ufffd":
        n += 1
    return n
