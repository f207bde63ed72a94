"""API-key and admin-key authentication as pure-ASGI middleware, decided on the raw path.

Why the raw path, normalised the strictest way: the router, a proxy in front of us and this
check may each read a URL differently (vLLM GHSA-94f4-hr76-p5j6 matched on a URL Starlette
rebuilt from the ``Host`` header). So the check never uses the Host header or a rebuilt URL.
It normalises both ``scope["raw_path"]`` and ``scope["path"]`` (percent-decode until stable,
``\\`` read as ``/``, empty segments dropped, ``.``/``..`` resolved, lower-cased, no trailing
``/``), classifies each, and applies the STRICTER of the two classes:

    admin   the normalised path starts with ``/admin`` or
            ``/v1/gateway`` (adding a replica routes users'
            prompts and images to it)                         -> an admin key
    api     any path that is not exactly a public path        -> an API key (or an admin key)
    public  ``/health``, ``/ready`` (and ``/metrics`` if public) -> open

So ``//admin/state``, ``/v1/../admin/state``, ``/ADMIN/state``, ``/admin/state/``,
``/%61dmin/state``, ``/v1%2f..%2fadmin`` and ``/V1//Gateway/register`` all need an admin key,
whatever the router makes of them.

Keys come from ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` and are compared with
``hmac.compare_digest`` against every configured key (no early exit). With no API keys
configured, non-admin routes are open. With no admin keys configured, admin routes are CLOSED
(403): an operator who set only API keys must not get an open admin API by accident.

A request let through with a key (API keys configured) carries the key's identity for what it
owns (files, batches): ``scope["state"]["owner"]`` = ``owner_of(key)``, a SHA-256 digest, never
the key itself. Without configured API keys there is one owner, ``ANONYMOUS``.

One exception to "an API key on every api path": a GET of one stream (``/v1/streams/<id>``)
or one response with ``stream=true``, carrying ``?token=`` and no key, is let through with the
owner ``RESUME_TOKEN_OWNER`` (no key's namespace): its route opens only the session that token
was issued for (``resume_token.py``; a browser's EventSource cannot send a header).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections.abc import Sequence
from enum import IntEnum
from urllib.parse import unquote_to_bytes

from starlette.types import ASGIApp, Receive, Scope, Send

from vlmserve.api.errors import error_body
from vlmserve.api.resume_token import RESUME_TOKEN_OWNER, token_request
from vlmserve.errors import AuthenticationError

__all__ = [
    "ADMIN_PREFIXES",
    "ANONYMOUS",
    "Access",
    "AuthMiddleware",
    "classify_path",
    "normalize_path",
    "owner_of",
]

_MAX_DECODE_ROUNDS = 8
# Normalised path prefixes that need an admin key: the admin API, and the gateway's control
# routes (registering a replica sends it users' traffic; the replica list shows upstream URLs).
ADMIN_PREFIXES = ("/admin", "/v1/gateway")
ANONYMOUS = "anonymous"  # the one owner when no API keys are configured


def owner_of(key: bytes) -> str:
    """The identity a key's files and batches are stored under (the key is never stored)."""
    return "key-" + hashlib.sha256(b"vlmserve-owner:" + key).hexdigest()[:32]


class Access(IntEnum):
    """What a path needs; a larger value is stricter."""

    PUBLIC = 0
    API = 1
    ADMIN = 2


_REMEMBERED_PATH_CHARS = 256  # paths up to this long have their class remembered


def normalize_path(path: str | bytes) -> str:
    """The strictest reading of a URL path: ``"/V1/%2e%2e//Admin/x/"`` -> ``"/admin/x"``."""
    raw = path.encode("utf-8", errors="surrogateescape") if isinstance(path, str) else path
    raw = raw.partition(b"?")[0]
    for _ in range(_MAX_DECODE_ROUNDS):  # "%252e" -> "%2e" -> "."
        decoded = unquote_to_bytes(raw)
        if decoded == raw:
            break
        raw = decoded
    text = raw.decode("utf-8", errors="replace").replace("\\", "/").lower()
    segments: list[str] = []
    for segment in text.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def classify_path(path: str | bytes, public_paths: frozenset[str]) -> Access:
    """Classify one path (raw or decoded); ``public_paths`` must already be normalised.
    Remembered for short paths (a request's is classified twice, decoded and raw, ~3 µs each
    otherwise); a long one, which a client without a key may send, is never held."""
    if len(path) <= _REMEMBERED_PATH_CHARS:
        return _classify_remembered(path, public_paths)
    return _classify(path, public_paths)


@functools.lru_cache(maxsize=4096)
def _classify_remembered(path: str | bytes, public_paths: frozenset[str]) -> Access:
    return _classify(path, public_paths)


def _classify(path: str | bytes, public_paths: frozenset[str]) -> Access:
    normal = normalize_path(path)
    if normal.startswith(ADMIN_PREFIXES) or _still_encoded(normal):
        return Access.ADMIN
    if normal in public_paths:
        return Access.PUBLIC
    return Access.API


def _still_encoded(normal: str) -> bool:
    """True for a path that did not stop decoding within the round limit: treat as hostile."""
    as_bytes = normal.encode("utf-8", errors="surrogateescape")
    return unquote_to_bytes(as_bytes) != as_bytes


def _strictest(scope: Scope, public_paths: frozenset[str]) -> Access:
    candidates: list[str | bytes] = [scope.get("path", "") or "/"]
    raw = scope.get("raw_path")
    if raw:
        candidates.append(raw)
    return max(classify_path(p, public_paths) for p in candidates)


def _normal_paths(scope: Scope) -> list[str]:
    paths: list[str | bytes] = [scope.get("path", "") or "/", scope.get("raw_path") or b""]
    return [normalize_path(p) for p in paths if p]


def _presented_key(scope: Scope) -> bytes | None:
    """The key from ``Authorization: Bearer`` (preferred) or ``x-api-key``; never logged."""
    bearer: bytes | None = None
    header_key: bytes | None = None
    for name, value in scope.get("headers", []):
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                bearer = token.strip()
        elif name == b"x-api-key" and header_key is None:
            header_key = value.strip() or None
    return bearer or header_key


def _matches_any(given: bytes, keys: Sequence[bytes]) -> bool:
    """Compare against every key, always all of them, in constant time per key."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


class AuthMiddleware:
    """401/403 before routing for requests without the key their path needs (see module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Sequence[str] = (),
        admin_keys: Sequence[str] = (),
        public_paths: Sequence[str] = ("/health", "/ready"),
        metrics_public: bool = True,
        metrics_path: str = "/metrics",
    ):
        if isinstance(api_keys, str) or isinstance(admin_keys, str):
            raise TypeError("api_keys and admin_keys must be sequences of keys, not one string")
        self.app = app
        self._api_keys = tuple(k.encode() for k in api_keys if k)
        self._admin_keys = tuple(k.encode() for k in admin_keys if k)
        publics = [*public_paths, *([metrics_path] if metrics_public else [])]
        self._public = frozenset(normalize_path(p) for p in publics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        denial = self._check(scope)
        if denial is None:
            given = _presented_key(scope) if self._api_keys else None
            owner = ANONYMOUS if given is None else owner_of(given)
            if given is None and self._api_keys and _strictest(scope, self._public) is Access.API:
                owner = RESUME_TOKEN_OWNER  # let in by its resume token alone
            scope.setdefault("state", {})["owner"] = owner
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _send_error(send, *denial)

    def _check(self, scope: Scope) -> tuple[int, str, str, str] | None:
        """None to let the request through, else (status, message, type, code)."""
        access = _strictest(scope, self._public)
        if access is Access.PUBLIC:
            return None
        if access is Access.ADMIN:
            if not self._admin_keys:
                message = (
                    "admin API disabled: set VLMSERVE_ADMIN_KEYS (this route is an admin route: "
                    "/admin/* and the gateway's /v1/gateway/*)"
                )
                return 403, message, "permission_error", "admin_disabled"
            keys = self._admin_keys
        else:
            if not self._api_keys:
                return None
            keys = self._api_keys + self._admin_keys
        given = _presented_key(scope)
        if given is not None and _matches_any(given, keys):
            return None
        if given is None and access is Access.API and token_request(scope, _normal_paths(scope)):
            return None  # its route opens only the session the token was issued for
        what = "an admin key" if access is Access.ADMIN else "an API key"
        message = (
            f"missing or invalid key: this route needs {what}; "
            "send it as 'Authorization: Bearer <key>'"
        )
        return 401, message, AuthenticationError.error_type, "invalid_api_key"


async def _send_error(send: Send, status: int, message: str, type_: str, code: str) -> None:
    body = json.dumps(error_body(message, type_, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
