"""Large JSON answers written without holding the event loop.

FastAPI turns a returned dict into JSON with ``jsonable_encoder`` and ``json.dumps`` on the
event loop: a non-streamed ``n: 8, logprobs, top_logprobs: 20`` answer of thousands of tokens
(tens of MiB) stalls every other request for seconds. ``json_response`` serialises with orjson
in a worker thread, in pieces (a long list ``_PIECE`` items per orjson call), so no single GIL
hold is long, and returns a prepared ``Response`` that FastAPI sends as is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import orjson
from fastapi import Response

__all__ = ["dumps", "json_response"]

_PIECE = 256  # list items per orjson call: ~0.4 MiB of logprobs entries with 20 alternatives
_MAX_DEPTH = 6  # containers walked into; deeper ones are serialised whole
_INLINE_ITEMS = 64  # an answer with no list longer than this is serialised on the loop


def _whole(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):  # an integer wider than 64 bits
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _pieces(value: Any, depth: int) -> Iterator[bytes]:
    if isinstance(value, list) and len(value) > _PIECE:
        yield b"["
        for start in range(0, len(value), _PIECE):
            piece = _whole(value[start : start + _PIECE])
            yield (b"," if start else b"") + piece[1:-1]
        yield b"]"
    elif depth >= _MAX_DEPTH or not isinstance(value, dict | list) or not value:
        yield _whole(value)
    elif isinstance(value, dict):
        for i, (key, item) in enumerate(value.items()):
            yield (b"{" if i == 0 else b",") + _whole(str(key)) + b":"
            yield from _pieces(item, depth + 1)
        yield b"}"
    else:
        for i, item in enumerate(value):
            yield b"[" if i == 0 else b","
            yield from _pieces(item, depth + 1)
        yield b"]"


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON, serialised piece by piece."""
    return b"".join(_pieces(value, 0))


def _small(value: Any, depth: int = 0) -> bool:
    """No list in the top levels is long: cheap enough to serialise on the loop."""
    if isinstance(value, list):
        return len(value) <= _INLINE_ITEMS and (
            depth >= 4 or all(_small(v, depth + 1) for v in value)
        )
    if isinstance(value, dict) and depth < 4:
        return all(_small(v, depth + 1) for v in value.values())
    return True


async def json_response(value: Any, status_code: int = 200) -> Response:
    """A prepared JSON ``Response``; large values are serialised in a worker thread."""
    data = _whole(value) if _small(value) else await asyncio.to_thread(dumps, value)
    return Response(data, status_code=status_code, media_type="application/json")
