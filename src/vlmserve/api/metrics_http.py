"""The request counter of ``/metrics``: a pure-ASGI middleware that counts requests by route
template (never by concrete path), model and status (``metrics.py`` has the series)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from vlmserve.api.metrics import Metrics

__all__ = ["UNMATCHED", "MetricsMiddleware"]

UNMATCHED = "unmatched"


def _flat_routes(routes: Iterable[object]) -> Iterable[object]:
    """Routes with their paths, descending into included routers: FastAPI >= 0.16x keeps an
    ``include_router`` as one nested entry (``original_router``) instead of copying its routes."""
    for route in routes:
        nested = getattr(route, "original_router", None)
        if nested is not None:
            yield from _flat_routes(getattr(nested, "routes", ()))
        else:
            yield route


# app -> {(method, path): template}, for paths that are their own template
_STATIC: weakref.WeakKeyDictionary[object, dict[tuple[str, str], str]] = weakref.WeakKeyDictionary()
_STATIC_MAX = 1024  # per app
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def _template_before_routing(scope: Scope) -> str:
    """The route template the router will pick, remembered for paths that are their own
    template (``/v1/chat/completions``; not ``/v1/streams/<id>``): matching every route in
    turn cost ~80 us per request, the metrics' largest share of a proxied request's time."""
    app, key = scope.get("app"), (scope.get("method", ""), scope["path"])
    known = _STATIC.setdefault(app, {}) if app is not None else {}
    found = known.get(key)
    if found is None:
        found = _match_template(scope)
        if found == scope["path"] and key[0] in _METHODS and len(known) < _STATIC_MAX:
            known[key] = found
    return found


def _match_template(scope: Scope) -> str:
    """The route template the router will pick (full match first, then partial), or unmatched."""
    routes: Iterable[object] = getattr(getattr(scope.get("app"), "router", None), "routes", ())
    partial: str | None = None
    for route in _flat_routes(routes):
        matches = getattr(route, "matches", None)
        path = getattr(route, "path", None)
        if matches is None or not isinstance(path, str):
            continue
        match, _ = matches(scope)
        if match is Match.FULL:
            return path
        if match is Match.PARTIAL and partial is None:
            partial = path
    return partial or UNMATCHED


def _template_after_routing(scope: Scope, fallback: str) -> str:
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) and path else fallback


class MetricsMiddleware:
    """Counts HTTP requests by route template, model and status; tracks in-flight per route.

    Add it OUTSIDE the auth middleware so 401/403 are counted too. In-flight uses the template
    found before routing (the router has not run yet); the final count prefers the router's own
    ``scope["route"]``. A request that raises counts as 500, one cancelled before it answered
    (client gone) as 499; in-flight always returns to where it was.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        early = _template_before_routing(scope)
        self.metrics.request_started(early)
        started = asyncio.get_running_loop().time()
        status = 0

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except asyncio.CancelledError:
            status = status or 499
            raise
        except BaseException:
            status = status or 500  # once started, count what the client saw
            raise
        finally:
            model = state.get("model") if isinstance(state, dict) else None
            self.metrics.request_finished(
                route=_template_after_routing(scope, early),
                in_flight_route=early,
                model=str(model or ""),
                status=status or 500,
                seconds=asyncio.get_running_loop().time() - started,
            )
