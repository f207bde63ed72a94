"""What a media worker runs: read one source, then the decode function given, unchanged.

``read_and_decode(source, policy, kind, decode, *args, **kwargs)`` is ``read_source`` followed
by ``decode(data, *args, **kwargs)``, in the worker, so a data: URL's base64 is decoded there
too and the API process holds neither the raw bytes nor a decoder's temporaries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from vlmserve.media.fetch import MediaKind, read_source
from vlmserve.media.policy import MediaPolicy

__all__ = ["read_and_decode"]

T = TypeVar("T")


def read_and_decode(
    source: str,
    policy: MediaPolicy,
    kind: MediaKind,
    decode: Callable[..., T],
    *args: Any,
    **kwargs: Any,
) -> tuple[T, int]:
    """``(decode(data, *args, **kwargs), len(data))`` for the bytes ``source`` names."""
    data = asyncio.run(read_source(source, policy, kind=kind))
    return decode(data, *args, **kwargs), len(data)
