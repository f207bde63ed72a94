"""Keywords for the personal tagger (``vlmserve tag``): a bounded JSON array of short strings.

The request asks for ``{"keywords": [...]}`` through ``response_format`` json_schema; the
answer is parsed and cleaned (trimmed, lower-cased, de-duplicated). An answer cut off by
``max_tokens`` keeps the keywords that were complete.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vlmserve.tasks.schema import parse_json, schema_errors

__all__ = [
    "KEYWORD_MAX_LENGTH",
    "keywords_prompt",
    "keywords_schema",
    "parse_keywords",
]

KEYWORD_MAX_LENGTH = 40
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def keywords_schema(max_keywords: int = 10) -> dict[str, Any]:
    item = {"type": "string", "maxLength": KEYWORD_MAX_LENGTH}
    return {
        "type": "object",
        "properties": {"keywords": {"type": "array", "items": item, "maxItems": max_keywords}},
        "required": ["keywords"],
    }


def keywords_prompt(noun: str, max_keywords: int = 10) -> str:
    return (
        f"List up to {max_keywords} keywords for this {noun}: subjects, objects, place, "
        'activity, style. Answer with JSON only: {"keywords": ["...", "..."]}.'
    )


def _clean(words: list[Any], limit: int) -> list[str]:
    out: list[str] = []
    for word in words:
        if not isinstance(word, str):
            continue
        word = " ".join(word.split()).strip(" .,;").lower()[:KEYWORD_MAX_LENGTH]
        if word and word not in out:
            out.append(word)
    return out[:limit]


def _salvage(text: str) -> list[Any]:
    """The complete strings of a cut-off ``{"keywords": ["a", "b", "c`` answer."""
    start = text.find("[")
    if not text.lstrip().startswith("{") or start < 0:
        raise ValueError("the answer is not the JSON object asked for")
    words = []
    for raw in _STRING.findall(text[start + 1 :]):
        try:
            words.append(json.loads(f'"{raw}"'))
        except ValueError:  # a broken escape: skip that word
            continue
    return words


def parse_keywords(text: str, max_keywords: int = 10, *, truncated: bool = False) -> list[str]:
    """The keywords of a model answer; ValueError (saying why) if it is not the asked shape.

    ``truncated``: the answer hit ``max_tokens``; keep what was complete instead of failing.
    """
    try:
        data = parse_json(text)
    except ValueError:
        if not truncated:
            raise
        return _clean(_salvage(text), max_keywords)
    errors = schema_errors(data, keywords_schema(10_000))
    if errors:
        raise ValueError(f"keywords answer does not fit the schema: {errors[0]}")
    return _clean(data["keywords"], max_keywords)
