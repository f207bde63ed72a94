"""Request lists whose length is checked before their items are validated.

pydantic checks a list's ``max_length`` while it validates the items, so a request with 5,000
messages against a limit of 4,096 has 4,097 of them fully validated (nested models, content
parts, Unicode checks) before its 400. ``counted_first`` counts the raw list first: an oversized one
is refused in microseconds, with the same error pydantic would give.
"""

from __future__ import annotations

from typing import Any

from pydantic import BeforeValidator
from pydantic_core import PydanticKnownError

__all__ = ["MAX_MESSAGES", "counted_first"]

MAX_MESSAGES = 4096  # messages in one request


def counted_first(limit: int) -> BeforeValidator:
    """A validator, placed before the list's own schema, that refuses more than ``limit``
    items before any of them is validated (``too_long``, as pydantic's ``max_length``)."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise PydanticKnownError(
                "too_long", {"field_type": "List", "max_length": limit, "actual_length": len(value)}
            )
        return value

    return BeforeValidator(check)
