"""What a model replica sends its ingress through a Ray deployment handle.

A replica streams ``(kind, value)`` pairs: first ``("ready", None)`` once the request is
prepared (template, processor, context length: a bad request fails before the client's stream
starts) or ``("error", ...)``; then ``("chunk", Chunk)`` items. Errors travel as plain data
(``encode_error``/``decode_error``) rather than as pickled exceptions: Ray re-raises a remote
exception wrapped in its own ``RayTaskError``, and ``VlmserveError``'s keyword fields (``param``,
``code``, ``retry_after``) would not survive pickling, so a 400 would turn into a 500.
"""

from __future__ import annotations

from typing import Any

from vlmserve import errors
from vlmserve.engine.types import Serves
from vlmserve.errors import VlmserveError

__all__ = ["CHUNK", "ERROR", "READY", "decode_error", "encode_error", "serves_of"]

READY, CHUNK, ERROR = "ready", "chunk", "error"


def encode_error(exc: VlmserveError) -> dict[str, Any]:
    """The fields that make the same OpenAI error JSON on the ingress."""
    return {
        "class": type(exc).__name__,
        "message": exc.message,
        "param": exc.param,
        "code": exc.code,
        "retry_after": getattr(exc, "retry_after", None),
    }


def decode_error(data: dict[str, Any]) -> VlmserveError:
    """The exception ``encode_error`` described (``VlmserveError`` for an unknown class)."""
    cls = getattr(errors, str(data.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, VlmserveError)):
        cls = VlmserveError
    message = str(data.get("message", "model replica error"))
    kwargs: dict[str, Any] = {"param": data.get("param"), "code": data.get("code")}
    if issubclass(cls, (errors.Overloaded, errors.ServiceUnavailable)):
        kwargs["retry_after"] = data.get("retry_after") or 1.0
    try:
        return cls(message, **kwargs)
    except TypeError:  # a subclass with another signature
        return cls(message)


def serves_of(roles: list[str]) -> Serves:
    """What a model with these roles answers: embeddings for the ``embedding`` role, else
    chat (as ``registry.build.hf_backend`` decides)."""
    return Serves.EMBEDDING if Serves.EMBEDDING.value in roles else Serves.CHAT
