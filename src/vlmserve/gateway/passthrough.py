"""PassthroughMiddleware: the gateway's lean path for chat.

A ``POST /v1/chat/completions`` for an ``openai`` model whose replicas are vlmserve workers
(``gateway/upstream_passthrough.py``) skips the gateway's own request model, session and chunk
re-encoding: its bytes go to a replica as they came (the ``model`` name swapped when the
upstream calls it otherwise), and the answer's bytes come back as the worker writes them (a
stream event by event, the worker's ``X-Session-ID`` included; a JSON answer whole), with the
``model`` in them renamed to the gateway's entry. Resumes (``GET /v1/streams/<id>``,
``Last-Event-ID``) and cancels (``/v1/cancel/<id>``, ``/v1/chat/completions/<chatcmpl-id>/
cancel``) of such a stream go to the replica that holds it.

It sits inside the other middlewares (request id, metrics, auth, activity, body limit apply as
to any request). Everything else, and what it cannot pass (another backend, a replica that is
not a vlmserve worker, a gateway with a durable store of its own, a ``session_id`` already in
use here, or any ``session_id`` when API keys are configured: the workers see the gateway's one
key, so a client's own name is kept apart per key by the gateway's own session), goes on to the
full path with its body replayed. A passed stream is its client's key's: a resume or cancel
by another key (or by a resume token, which a worker cannot check for the gateway) goes on to
the full path, which answers an unknown id's 404. Off with
``VLMSERVE_GATEWAY_PASSTHROUGH=false``.

Measured (``benchmarks/overhead.py``, c=1, request by request): the full path cost the gateway
~1.1 ms before its upstream request was written (middlewares 0.35 ms, FastAPI and the request
model 0.6 ms, lease and body 0.2 ms) and ~0.8 ms after the upstream's headers (session, SSE
response), work that shares the 2 cores with the worker's prefill.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from vlmserve.config import Settings
from vlmserve.engine.protocol import Backend, PassedAnswer, Proxied, as_proxied
from vlmserve.engine.types import ModelState, Serves
from vlmserve.errors import VlmserveError
from vlmserve.gateway.media_routes import has_uuids
from vlmserve.gateway.passed import PassedStream, PassedStreams
from vlmserve.gateway.passthrough_relay import (
    GenerationMetrics,
    Observed,
    read_body,
    relay,
    relay_whole,
    replay,
    unless_gone,
)
from vlmserve.streaming import SessionManager, parse_event_id
from vlmserve.streaming.store.base import already_exists

__all__ = ["ErrorAnswer", "Models", "PassthroughMiddleware"]

CHAT = "/v1/chat/completions"
_REQUEST_HEADERS = ("accept", "last-event-id", "content-type")
_COMPLETION_ID = re.compile(rb'"id":\s*"(chatcmpl-[A-Za-z0-9_-]{1,200})"')
_MEDIA = {
    "image_url": "vision",
    "input_image": "vision",
    "video_url": "video",
    "input_video": "video",
}


class _Held(Protocol):
    """A served model (a handle) or one request's hold on it (a lease)."""

    @property
    def backend(self) -> Backend: ...


class _Lease(_Held, Protocol):
    def release(self) -> None: ...


class Models(Protocol):
    """The served models (the registry's manager), as the pass-through uses them."""

    def resolve(self, name: str) -> _Held: ...

    @property
    def handles(self) -> Sequence[_Held]: ...

    async def acquire(
        self, name: str | None, role: str, serves: Serves, needs: frozenset[str] = ...
    ) -> _Lease: ...


ErrorAnswer = Callable[[VlmserveError], ASGIApp]  # the API's error answer (OpenAI's shape)


@dataclass(slots=True)
class _Plan:
    backend: Proxied
    name: str  # the model as the client named it
    content: bytes  # what goes upstream
    stream: bool
    needs: frozenset[str]
    rename: tuple[bytes, bytes] | None  # the upstream's "model" value -> the entry's name
    session_id: str | None  # the client's own, reserved while the pass starts
    owner: str  # the client's API key digest (auth's owner): its later requests only


class PassthroughMiddleware:
    """What it needs of the API comes in from ``api/app.py``: the settings, the sessions, the
    models, the metrics and the API's error answer (the gateway imports nothing of the API)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Settings,
        sessions: SessionManager,
        models: Models,
        metrics: GenerationMetrics,
        errors: ErrorAnswer,
    ) -> None:
        self.app = app
        self.settings, self.sessions, self.models = settings, sessions, models
        self.metrics, self.errors = metrics, errors
        self.streams = PassedStreams(settings.sessions_ttl_seconds)
        self._reserved: set[str] = set()  # client session ids of passes under way
        # A gateway with a durable store keeps its own sessions (restart, takeover, Redis).
        self.enabled = settings.gateway_passthrough and not sessions.durable

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] == CHAT:
            await self._chat(scope, receive, send)
            return
        passed = self._later_request(scope)
        if passed is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        await self._forward(passed, scope, body, receive, send)

    # --- deciding ------------------------------------------------------------------------
    def _later_request(self, scope: Scope) -> PassedStream | None:
        """A resume or cancel of a passed stream (None: anything else)."""
        if not len(self.streams):
            return None
        path, method, owner = scope["path"], scope["method"], _owner(scope)
        if method == "GET" and path.startswith("/v1/streams/"):
            return self.streams.get(path.removeprefix("/v1/streams/"), owner)
        if method == "POST" and path.startswith("/v1/cancel/"):
            return self.streams.get(path.removeprefix("/v1/cancel/"), owner)
        if method == "POST" and path.startswith(CHAT + "/") and path.endswith("/cancel"):
            return self.streams.get(path[len(CHAT) + 1 : -len("/cancel")], owner)
        return None

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        given = _resume_from(scope)
        resumed = None if given is None else self._resumed(given, _owner(scope))
        if resumed is not None:
            await self._forward(resumed, scope, body, receive, send)
            return
        try:
            plan = None if given is not None or not self._proxies() else self._plan(body, scope)
        except VlmserveError as exc:  # a session_id a passed stream has
            await self.errors(exc)(scope, receive, send)
            return
        if plan is None:
            await self.app(scope, replay(body, receive), send)
            return
        await self._pass(plan, scope, body, receive, send)

    def _resumed(self, given: str, owner: str) -> PassedStream | None:
        """The passed stream a chat POST's ``Last-Event-ID`` names (None: not one)."""
        if not len(self.streams):
            return None
        try:
            session_id, _ = parse_event_id(given)
        except VlmserveError:
            return None  # the full path answers the 400
        return self.streams.get(session_id, owner)

    def _proxies(self) -> bool:
        """Whether a served model is proxied: without one nothing is passed, and the body
        (an image request's is hundreds of KB) is not parsed here as well."""
        return any(handle.backend.proxied for handle in self.models.handles)

    def _plan(self, body: bytes, scope: Scope) -> _Plan | None:
        """What to pass, or None for the full path (which answers any 4xx of its own)."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        name, session_id = data.get("model"), data.get("session_id")
        if session_id is not None and self.settings.api_keys:
            return None  # the workers see one key, the gateway's: its own session keeps it apart
        if not isinstance(name, str) or (session_id is not None and not self._free(session_id)):
            return None
        try:
            backend = as_proxied(self.models.resolve(name).backend)
        except VlmserveError:
            return None
        if backend is None:
            return None  # served here: the messages need no walk of ours
        if has_uuids(data):
            return None  # media by uuid: scoped to the key and routed on the full path
        media = _media_kinds(data)
        if not self._within_limits(data, len(media)):
            return None
        upstream = backend.upstream_name
        if backend.state is ModelState.READY and not backend.passes_streams():
            return None  # not loaded yet: asked again once the lease has loaded it
        ours = backend.model_id  # what the chunks name, as on the full path
        rename = (
            None
            if upstream == ours
            else (b'"model":' + orjson.dumps(upstream), b'"model":' + orjson.dumps(ours))
        )
        stream, needs = data.get("stream") is True, frozenset(media)
        if upstream != name:
            data["model"] = upstream
            try:
                body = orjson.dumps(data)
            except TypeError:
                return None  # an integer orjson cannot write: the full path takes it
        return _Plan(backend, name, body, stream, needs, rename, session_id, _owner(scope))

    def _within_limits(self, data: dict[str, Any], media: int) -> bool:
        """The gateway's own request limits (``Converter.check``'s counts), read off the raw
        body; a request over one goes to the full path, which refuses it with the same 400."""
        settings = self.settings
        n = data.get("n", 1)
        tokens = data.get("max_completion_tokens") or data.get("max_tokens") or 0
        if not isinstance(n, int) or not isinstance(tokens, int):
            return False
        return (
            n <= settings.max_n
            and tokens < settings.max_model_len
            and media <= settings.max_media_per_request
        )

    def _free(self, session_id: object) -> bool:
        """A client's own ``session_id`` that no stream here has: False sends it to the full
        path (a session of the gateway's own has it: its 400); a passed stream's is a 400."""
        if not isinstance(session_id, str) or self.sessions.get(session_id) is not None:
            return False
        if self.streams.get(session_id) is not None or session_id in self._reserved:
            raise already_exists(session_id)
        return True

    # --- passing -------------------------------------------------------------------------
    async def _pass(
        self, plan: _Plan, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        scope.setdefault("state", {})["model"] = plan.name  # the metrics' model label
        try:
            lease = await self.models.acquire(plan.name, "chat", Serves.CHAT, plan.needs)
        except VlmserveError as exc:
            await self.errors(exc)(scope, receive, send)
            return
        reserved = plan.session_id
        try:
            backend = as_proxied(lease.backend)
            if backend is None or not backend.passes_streams():  # loaded just now: its replicas
                await self.app(scope, replay(body, receive), send)  # are not workers after all
                return
            if reserved is not None:
                self._reserved.add(reserved)
            passing = self._passed(plan, backend, scope, receive, send)
            # a JSON answer comes whole at its end: a client that leaves first cancels it
            await (passing if plan.stream else unless_gone(passing, receive))
        finally:
            self._reserved.discard(reserved or "")
            lease.release()

    async def _passed(
        self, plan: _Plan, backend: Proxied, scope: Scope, receive: Receive, send: Send
    ) -> None:
        try:
            passage = await backend.pass_stream(CHAT, plan.content, _upstream_headers(scope))
        except VlmserveError as exc:
            await self.errors(exc)(scope, receive, send)
            return
        completed = False
        try:
            observed = Observed(self.metrics, backend.model_id)
            names = self._remember(plan, backend, passage)

            def see(events: bytes) -> None:
                names(events)
                observed(events)

            if plan.stream:
                completed = await relay(passage, receive, send, plan.rename, see, observed.finished)
            else:
                completed = await relay_whole(passage, send, plan.rename, see, observed.finished)
        except VlmserveError as exc:  # the answer broke off before any of it was sent
            await self.errors(exc)(scope, receive, send)
        finally:
            passage.close(completed)

    def _remember(
        self, plan: _Plan, backend: Proxied, passage: PassedAnswer
    ) -> Callable[[bytes], None]:
        """Route the stream's session id now, its completion id once the first event has it."""
        url = passage.replica_url
        session_id = passage.headers.get("x-session-id")
        if not session_id:
            return _ignore
        self.streams.add([session_id], backend, url, plan.rename, plan.owner)
        pending = [True]

        def see(events: bytes) -> None:
            if pending[0] and (found := _COMPLETION_ID.search(events)):
                pending[0] = False
                self.streams.add([found.group(1).decode()], backend, url, plan.rename, plan.owner)

        return see

    async def _forward(
        self, passed: PassedStream, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        """A later request of a passed stream, to its replica; its answer back as it comes."""
        query = scope["query_string"].decode("latin-1")
        path = scope["path"] + (f"?{query}" if query else "")
        models = self.models
        try:  # leased: a model unloaded meanwhile is routing again, and stays while it relays
            lease = await models.acquire(passed.backend.model_id, "chat", Serves.CHAT)
        except VlmserveError as exc:
            await self.errors(exc)(scope, receive, send)
            return
        backend = as_proxied(lease.backend)
        if backend is None:  # the entry is a local model now: the full path answers
            lease.release()
            await self.app(scope, replay(body, receive), send)
            return
        try:
            answer = await backend.pass_later(
                passed.replica_url, scope["method"], path, body or None, _upstream_headers(scope)
            )
        except VlmserveError as exc:
            lease.release()
            await self.errors(exc)(scope, receive, send)
            return
        completed = False
        try:
            completed = await relay(answer, receive, send, passed.rename, _ignore)
        finally:
            answer.close(completed)
            lease.release()


def _upstream_headers(scope: Scope) -> dict[str, str]:
    """Accept, Last-Event-ID and Content-Type as the client sent them, and the request id;
    never its credentials (the upstream gets the entry's own key)."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}  # lower case:
    given = dict(scope["headers"])  # a client's own content-type replaces the default, once
    for name in _REQUEST_HEADERS:
        if (value := given.get(name.encode())) is not None:
            headers[name] = value.decode("latin-1")
    request_id = scope.get("state", {}).get("request_id")
    if request_id:
        headers["x-request-id"] = request_id  # one id in both servers' logs
    return headers


def _owner(scope: Scope) -> str:
    return str(scope.get("state", {}).get("owner", ""))


def _resume_from(scope: Scope) -> str | None:
    given: bytes | None = dict(scope["headers"]).get(b"last-event-id")
    if given:
        return given.decode("latin-1")
    if scope["query_string"]:
        values = parse_qs(scope["query_string"].decode("latin-1")).get("last_event_id")
        return values[0] if values else None
    return None


def _media_kinds(data: dict[str, Any]) -> list[str]:
    """The kind of each media part of a raw request, in order: what it needs of its model
    (as ``Converter.needs``, without parsing it) and how many media items it has."""
    kinds = []
    messages = data.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and (kind := _MEDIA.get(kind)):
                kinds.append(kind)
    return kinds


def _ignore(events: bytes) -> None:
    pass
