"""Resume tokens: how a browser's ``EventSource``, which cannot send an ``Authorization``
header, resumes a stream when API keys are configured.

Every stream answer (a chat stream, a stored or background response) carries a random token
for its session: the ``X-Resume-Token`` header (exposed to CORS) and ``resume_token`` in the
first SSE event's JSON. Only its SHA-256 digest is kept, as an alias of the session outside
every key's namespace (``streaming/scope.py``), so it lives in the store with the session
(across restarts and replicas) and the token itself is never stored. ``?token=`` is accepted
on two routes only, ``GET /v1/streams/{id}`` and ``GET /v1/responses/{id}?stream=true``, and
only opens the session it was issued for, under any of its names; anything else is the 404
of an unknown id. It is redacted from the access log (``redact_tokens``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from urllib.parse import parse_qs

from starlette.types import Scope

__all__ = [
    "HEADER",
    "RESUME_TOKEN_OWNER",
    "issue",
    "redact_tokens",
    "token_alias",
    "token_request",
    "with_token",
]

HEADER = "X-Resume-Token"
# request.state.owner of a request let in by its token alone: no key's namespace is theirs
RESUME_TOKEN_OWNER = "resume-token"
_MAX_TOKEN_CHARS = 128
_STREAM = re.compile(r"/v1/streams/[^/]+")
_RESPONSE = re.compile(r"/v1/responses/[^/]+")
_TOKEN_IN_QUERY = re.compile(r"(?i)([?&]token=)[^&\s\"]*")


def issue() -> tuple[str, str]:
    """A new token and the session alias that stores its digest."""
    token = secrets.token_urlsafe(24)
    return token, token_alias(token)


def token_alias(token: str) -> str:
    return "rt-" + hashlib.sha256(token.encode()).hexdigest()


def with_token(data: str, token: str) -> str:
    """An event's JSON object with ``resume_token`` first (a token is URL-safe: no escaping)."""
    if not data.startswith("{"):
        return data
    rest = data[1:]
    return f'{{"resume_token":"{token}"' + ("," + rest if rest != "}" else "}")


def token_request(scope: Scope, normal_paths: list[str]) -> bool:
    """Whether a request may be let in by a ``?token=`` alone: a GET of one stream, or of one
    response with ``stream=true`` (every reading of its path, raw and decoded, must say so)."""
    if scope.get("method") != "GET":
        return False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))  # blanks dropped
    tokens = query.get("token", [])
    if len(tokens) != 1 or len(tokens[0]) > _MAX_TOKEN_CHARS:
        return False
    if all(_STREAM.fullmatch(path) for path in normal_paths):
        return True
    streamed = query.get("stream") == ["true"]
    return streamed and all(_RESPONSE.fullmatch(path) for path in normal_paths)


class _RedactTokens(logging.Filter):
    """``token=<value>`` in an access-log line (uvicorn logs the query string) -> ``token=***``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        return True


_FILTER = _RedactTokens()


def redact_tokens(logger_names: tuple[str, ...] = ("uvicorn.access", "vlmserve.access")) -> None:
    """Install the redaction on the access loggers (once; idempotent)."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
