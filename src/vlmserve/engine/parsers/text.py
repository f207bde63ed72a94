"""Text helpers shared by the streaming parsers."""

from __future__ import annotations

__all__ = ["partial_suffix"]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``.

    A streaming parser holds those characters back: the next delta may complete the tag.
    """
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
