"""Route class for every router: JSON bodies with non-finite numbers are refused.

Python's ``json`` reads ``NaN``, ``Infinity`` and ``1e999`` (as ``inf``); such a value can
reach a response, where it cannot be written as JSON (a 500). Refusing it at the door keeps
every number a client sends finite.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

__all__ = ["StrictJSONRoute"]


class _NonFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _no_constant(text: str) -> Any:
    raise _NonFinite(text)


def strict_loads(body: bytes | str) -> Any:
    """``json.loads`` that refuses NaN, Infinity and numbers too large for a float."""
    try:
        return json.loads(body, parse_float=_finite_float, parse_constant=_no_constant)
    except _NonFinite as exc:
        doc = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        raise json.JSONDecodeError(
            f"numbers must be finite JSON numbers; got {exc}", doc, 0
        ) from None


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictRequest(request.scope, request.receive))

        return strict_handler
