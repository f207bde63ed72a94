"""The OpenAI wire as an upstream proxy sees it: the body it sends, the SSE it reads, errors.

Pure functions over dicts and lines (no I/O), so the proxy's translation is tested on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from vlmserve.engine.types import Chunk, FinishReason
from vlmserve.errors import VlmserveError

__all__ = [
    "ChunkReader",
    "UpstreamError",
    "encode_body",
    "error_from_body",
    "json_object",
    "upstream_body",
]

# Fields of our own wire that an upstream must not see: the gateway runs the session itself
# (and its clients' choice of wire); the upstream answers on the OpenAI wire, or with `id:`
# lines if it is an older vlmserve: ``ChunkReader`` reads both.
_GATEWAY_ONLY = ("session_id",)
_GATEWAY_ONLY_STREAM_OPTIONS = ("resumable",)
_FINISH = {r.value: r for r in FinishReason}


class UpstreamError(VlmserveError):
    """An upstream's own 4xx, passed on with its status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.status_code = status_code
        self.error_type = error_type


def upstream_body(raw: dict[str, Any], model: str, *, stream: bool = True) -> dict[str, Any]:
    """The client's body for the upstream: its model name, streaming with a usage chunk."""
    body = {k: v for k, v in raw.items() if k not in _GATEWAY_ONLY}
    body["model"] = model
    if stream:
        body["stream"] = True
        options = {
            k: v
            for k, v in (body.get("stream_options") or {}).items()
            if k not in _GATEWAY_ONLY_STREAM_OPTIONS
        }
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def announces_sessions(health: bytes) -> bool:
    """Whether a ``GET /health`` answer is a vlmserve worker's that runs resumable streams
    (``"resumableStreams": true``): the gateway may then pass its streams through as bytes."""
    try:
        data = json.loads(health)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("resumableStreams") is True


def error_from_body(status: int, content: bytes) -> UpstreamError:
    """An upstream error answer (OpenAI ``{"error": {...}}`` or vLLM's flat shape)."""
    try:
        data = json.loads(content)
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        err = data if isinstance(data, dict) and "message" in data else {}
    message = str(err.get("message") or content[:500].decode(errors="replace") or "no details")
    code = err.get("code")
    return UpstreamError(
        message,
        status_code=status,
        error_type=str(err.get("type") or "invalid_request_error"),
        param=err.get("param") if isinstance(err.get("param"), str) else None,
        code=str(code) if code is not None and not isinstance(code, int) else None,
    )


@dataclass(slots=True)
class ChunkReader:
    """Upstream SSE -> ``Chunk``s. The finish reason is held back until the usage chunk
    (``stream_options.include_usage``) or the end, so the last Chunk carries the token counts.

    Reads the OpenAI wire (``data:`` lines; an error is ``data: {"error": {...}}``) and the
    resumable one (``id:`` lines skipped; ``event: error`` marks an error). ``feed_bytes`` takes
    the body as it comes off the socket, split anywhere: lines are cut from bytes and a
    ``data:`` payload goes to orjson as bytes, never decoded to ``str`` (the proxy's per-chunk
    work: no text decoder, no line-iterator generators)."""

    upstream_id: str | None = None  # the upstream's ``chatcmpl-...`` id (for its cancel route)
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # the upstream's ``prompt_tokens_details.cached_tokens``
    pieces: int = 0  # content chunks seen: the completion count when no usage comes
    done: bool = False
    _event: str | None = None
    _partial: bytes = b""  # the start of a line whose end has not arrived yet

    def feed_bytes(self, data: bytes) -> list[Chunk]:
        """Body bytes as received; returns the Chunks of the lines they complete."""
        buffer = self._partial + data
        if b"\r" in buffer:  # CRLF or CR line ends (SSE allows both)
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._partial = buffer.split(b"\n")
        out: list[Chunk] = []
        for line in lines:
            if line:
                out += self.feed(line)
            else:
                self._event = None
        return out

    def feed(self, line: str | bytes) -> list[Chunk]:
        """One SSE line (without its line end); returns the Chunks it completes (often none)."""
        raw = line.encode() if isinstance(line, str) else line
        if raw.startswith(b"data:"):
            value = raw[6:] if raw.startswith(b"data: ") else raw[5:]
            return self._data(value)
        if not raw:
            self._event = None
        elif raw.startswith(b"event:"):
            self._event = raw[6:].strip().decode(errors="replace")
        return []  # comments, id:, retry: and unknown fields

    def _data(self, value: bytes) -> list[Chunk]:
        if value == b"[DONE]":
            return self._finish()
        data = orjson.loads(value)  # per chunk: ~2.5x faster than json.loads
        if not isinstance(data, dict):
            raise VlmserveError(
                f"upstream sent a non-object chunk: {value[:200]!r}", code="upstream_error"
            )
        if self._event == "error" or "error" in data:
            raise _stream_error(data)
        return self._chunk(data)

    def _chunk(self, data: dict[str, Any]) -> list[Chunk]:
        self.upstream_id = self.upstream_id or data.get("id")
        usage = data.get("usage")
        if usage:
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.cached_tokens = _cached_tokens(usage)
        out: list[Chunk] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
            calls = delta.get("tool_calls") or None
            if text or reasoning or calls:
                self.pieces += 1
                out.append(
                    Chunk(
                        text,
                        [],
                        prompt_tokens=self.prompt_tokens,
                        completion_tokens=self.completion_tokens,
                        reasoning=reasoning,
                        tool_calls=calls,
                    )
                )
            reason = choice.get("finish_reason")
            if reason:
                self.finish = _FINISH.get(reason, FinishReason.STOP)
        if usage and self.finish is not None:
            out += self._finish()
        return out

    def close(self) -> list[Chunk]:
        """The stream ended: a last line left without its line end, then the held-back finish
        (if any) with the counts."""
        out: list[Chunk] = []
        if self._partial:
            partial, self._partial = self._partial, b""
            out = self.feed(partial)
        return out + self._finish()

    def _finish(self) -> list[Chunk]:
        """The held-back finish with the counts, once (``[DONE]``, the usage chunk, the end)."""
        if self.done or self.finish is None:
            self.done = self.done or self.finish is not None
            return []
        self.done = True
        completion = self.completion_tokens or self.pieces
        return [
            Chunk(
                "",
                [],
                self.finish,
                self.prompt_tokens,
                completion,
                cached_tokens=self.cached_tokens,
            )
        ]


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    """An upstream's cached prompt tokens (vLLM with prefix caching, a vlmserve worker), or
    None when it reports none (the answer then has no ``prompt_tokens_details``)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(cached) if isinstance(cached, int) and cached >= 0 else None


def _stream_error(data: dict[str, Any]) -> VlmserveError:
    inner = data.get("error")
    err: dict[str, Any] = inner if isinstance(inner, dict) else data
    message = str(err.get("message") or "the upstream stream failed")
    kind = str(err.get("type") or "")
    if "invalid_request" in kind or "not_found" in kind:
        return UpstreamError(
            message, status_code=400, error_type=kind, code=str(err.get("code") or "upstream_error")
        )
    return VlmserveError(f"upstream: {message}", code="upstream_error")


def json_object(content: bytes, where: str) -> dict[str, Any]:
    """A replica's 2xx JSON answer; anything else is the replica's fault (502)."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise UpstreamError(
            f"upstream {where} answered with something other than a JSON object",
            status_code=502,
            error_type="upstream_error",
            code="upstream_error",
        )
    return data


def encode_body(body: dict[str, Any]) -> bytes:
    """The body as JSON: orjson (a large inline image costs ~10x less), the standard library
    for what orjson refuses (an integer wider than 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()
