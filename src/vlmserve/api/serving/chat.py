"""Chat completions: JSON answers, and SSE streams that run as resumable sessions."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from vlmserve.api.metrics import Metrics
from vlmserve.api.protocol.chat import ChatCompletionRequest, StreamOptions
from vlmserve.api.protocol.responses import CompletionIds, chunk_json, completion_body, usage
from vlmserve.api.serving.convert import Converter, response_format
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import Chunk, FinishReason, GenerateRequest, Serves
from vlmserve.errors import InvalidRequest, ServiceUnavailable, VlmserveError
from vlmserve.registry.manager import Lease, ModelManager
from vlmserve.streaming import Emit, Event, Resumption, SessionManager, SessionRecord, error_emit

__all__ = ["ChatService"]

log = logging.getLogger(__name__)


def _new_ids(model: str) -> CompletionIds:
    return CompletionIds(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)


async def _emits(
    chunks: AsyncIterator[Chunk], ids: CompletionIds, options: StreamOptions | None, first: bool
) -> AsyncIterator[Emit]:
    """Engine chunks -> OpenAI ``chat.completion.chunk`` events (token ids kept in meta).

    ``stream_options``: ``include_usage`` adds a final usage-only chunk (OpenAI);
    ``continuous_usage_stats`` puts the running usage on every content chunk too (vLLM).
    """
    include_usage = bool(options and options.include_usage)
    running = bool(options and options.continuous_usage_stats)
    if first:
        yield Emit(chunk_json(ids, {"role": "assistant", "content": ""}))
    async for c in chunks:
        if c.text or c.token_ids:
            now = usage(c.prompt_tokens, c.completion_tokens) if running else None
            content = chunk_json(ids, {"content": c.text}, usage_=now)
            yield Emit(content, meta={"token_ids": c.token_ids})
        if c.finish_reason is not None:
            yield Emit(chunk_json(ids, {}, c.finish_reason.value))
            if include_usage:
                yield Emit(
                    chunk_json(ids, None, usage_=usage(c.prompt_tokens, c.completion_tokens))
                )


async def _leased(lease: Lease, emits: AsyncIterator[Emit]) -> AsyncIterator[Emit]:
    """Hold the model lease for as long as the stream produces (no idle unload meanwhile)."""
    try:
        async for emit in emits:
            yield emit
    finally:
        lease.release()


def _on_cancel(ids: CompletionIds) -> Any:
    return lambda: [Emit(chunk_json(ids, {}, FinishReason.CANCELLED.value))]


def _on_error(exc: BaseException) -> list[Emit]:
    """The stream's final error event: what a client may act on (its own 4xx, or a 503 such as
    ``engine_failed`` that says to retry), else a generic message (details in the log)."""
    if isinstance(exc, VlmserveError) and (
        exc.status_code < 500 or isinstance(exc, ServiceUnavailable)
    ):
        return [error_emit(exc.message, exc.code or "invalid_request", exc.error_type)]
    log.error("stream failed: %r", exc)
    return [error_emit("generation failed; the server log has the details", "internal_error")]


async def _observed(
    chunks: AsyncIterator[Chunk], metrics: Metrics | None, model: str
) -> AsyncIterator[Chunk]:
    """Pass chunks through, recording time to first token, token counts and duration."""
    started, first = time.perf_counter(), None
    async for chunk in chunks:
        if first is None and (chunk.token_ids or chunk.text):
            first = time.perf_counter() - started
        if chunk.finish_reason is not None and metrics is not None:
            total = time.perf_counter() - started
            metrics.observe_generation(
                model, prompt_tokens=chunk.prompt_tokens, output_tokens=chunk.completion_tokens,
                ttft=total if first is None else first, total=total,
            )  # fmt: skip
        yield chunk


def _admit(backend: Backend) -> Callable[[], None]:
    """Reserve a queue place (429 now when full); returns its release."""
    return backend.admit()


def _nothing() -> None:
    pass


async def _admitted(
    release: Callable[[], None], chunks: AsyncIterator[Chunk]
) -> AsyncIterator[Chunk]:
    """Hand the reserved queue place over as the engine takes the request (no await between)."""
    release()
    async for chunk in chunks:
        yield chunk


class ChatService:
    def __init__(
        self,
        models: ModelManager,
        converter: Converter,
        sessions: SessionManager,
        metrics: Metrics | None = None,
    ):
        self.models = models
        self.converter = converter
        self.sessions = sessions
        self.metrics = metrics
        sessions.set_resumer(self._resume)

    def _generate(self, backend: Backend, prepared: Any) -> AsyncIterator[Chunk]:
        return _observed(backend.generate(prepared), self.metrics, backend.model_id)

    async def _request(
        self, backend: Backend, body: ChatCompletionRequest, request_id: str
    ) -> GenerateRequest:
        """The engine request. A proxied model gets the wire body as is: its media are
        neither fetched nor decoded here (only ``Converter.check``'s limits apply)."""
        if not backend.proxied:
            return await self.converter.to_request(body, request_id)
        self.converter.check(body)
        return GenerateRequest(
            request_id, [], self.converter.sampling(body), response_format=response_format(body),
            raw=body.model_dump(mode="json", exclude_unset=True),
        )  # fmt: skip

    async def complete(self, body: ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        needs = self.converter.needs(body)
        async with await self.models.acquire(body.model, "chat", Serves.CHAT, needs) as backend:
            release = _admit(backend)
            try:
                prepared = await backend.prepare(await self._request(backend, body, request_id))
                ids = _new_ids(backend.model_id)
                text, last = [], None
                async for chunk in _admitted(release, self._generate(backend, prepared)):
                    text.append(chunk.text)
                    last = chunk
            finally:
                release()
        if last is None or last.finish_reason is None:
            raise VlmserveError("generation ended without a result")
        return completion_body(
            ids,
            "".join(text),
            last.finish_reason.value,
            usage(last.prompt_tokens, last.completion_tokens),
        )

    async def start_stream(self, body: ChatCompletionRequest, request_id: str) -> str:
        """Validate and prepare (4xx before any byte is sent), then start the session."""
        session_id = body.session_id or uuid.uuid4().hex
        if body.session_id and await self.sessions.exists(session_id):
            raise InvalidRequest(
                f"session {session_id!r} already exists; resume it with a Last-Event-ID header "
                "or start a new one with another session_id",
                param="session_id",
                code="session_exists",
            )
        needs = self.converter.needs(body)
        lease = await self.models.acquire(body.model, "chat", Serves.CHAT, needs)
        prepared, release = None, _nothing
        try:
            backend = lease.backend
            release = _admit(backend)  # a full queue is a 429 now, not an event in a 200 stream
            prepared = await backend.prepare(await self._request(backend, body, request_id))
            ids = _new_ids(backend.model_id)
            record = {"body": body.model_dump(mode="json"), "id": ids.id,
                      "created": ids.created, "model": ids.model}  # fmt: skip
            chunks = _admitted(release, self._generate(backend, prepared))
            emits = _emits(chunks, ids, body.stream_options, first=True)
            await self.sessions.start(
                session_id, record, _leased(lease, emits),
                on_cancel=_on_cancel(ids), on_error=_on_error, aliases=[ids.id],
            )  # fmt: skip
        except BaseException:
            release()
            if prepared is not None:
                await lease.backend.discard(prepared)
            lease.release()
            raise
        return session_id

    async def _resume(self, record: SessionRecord, events: list[Event]) -> Resumption | None:
        """After a restart: continue a stored generation after exactly the tokens already sent."""
        stored = record.request
        lease = None
        try:
            body = ChatCompletionRequest.model_validate(stored["body"])
            lease = await self.models.acquire(stored["model"], "chat", Serves.CHAT)
            if lease.backend.proxied:  # its tokens are the upstream's
                raise ValueError("a proxied generation cannot continue after a restart")
            request = await self.converter.to_request(body, f"resume-{record.session_id}")
            request.prefix_token_ids = [
                t for e in events if e.meta for t in e.meta.get("token_ids", [])
            ]
            prepared = await lease.backend.prepare(request)
        except (KeyError, VlmserveError, ValueError) as exc:
            if lease is not None:
                lease.release()
            log.warning("cannot continue session %s: %s", record.session_id, exc)
            return None
        ids = CompletionIds(id=stored["id"], created=stored["created"], model=stored["model"])
        chunks = self._generate(lease.backend, prepared)
        emits = _emits(chunks, ids, body.stream_options, first=not events)
        return Resumption(producer=_leased(lease, emits), on_cancel=_on_cancel(ids),
                          on_error=_on_error)  # fmt: skip
