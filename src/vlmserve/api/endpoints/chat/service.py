"""Chat completions: JSON answers, and SSE streams that run as resumable sessions."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.convert import Converter
from vlmserve.api.common.generation import (
    Generation,
    Leased,
    SentChoices,
    open_generation,
    seeded,
    sent_by_choice,
    sent_token_ids,
)
from vlmserve.api.common.keys import KeyPolicy
from vlmserve.api.common.timings import metrics_object
from vlmserve.api.endpoints.chat.choices import Answer, Usage, choice_chunk
from vlmserve.api.endpoints.chat.objects import CompletionIds, chunk_json, delta_of, usage
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest, StreamOptions
from vlmserve.api.metrics import Metrics
from vlmserve.api.resume_token import issue
from vlmserve.engine.choices import merge_choices, open_choices
from vlmserve.engine.types import INTERACTIVE_PRIORITY, Chunk, FinishReason
from vlmserve.errors import InvalidRequest, ServiceUnavailable, VlmserveError
from vlmserve.registry.manager import ModelManager
from vlmserve.streaming import Emit, Event, Resumption, SessionManager, SessionRecord, error_emit

__all__ = ["ChatService", "tenant_of"]

log = logging.getLogger(__name__)


def tenant_of(owner: str) -> str:
    """The namespace of ``owner``'s sessions (``streaming/scope.py``): none without keys."""
    return "" if owner == ANONYMOUS else owner


def _new_ids(model: str) -> CompletionIds:
    return CompletionIds(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)


_ROLE = {"role": "assistant"}


async def _emits(
    chunks: AsyncIterator[Chunk],
    ids: CompletionIds,
    options: StreamOptions | None,
    roles: set[int],
    n: int = 1,
    ended: dict[int, int] | None = None,
    timed: bool = False,
    sent: SentChoices | None = None,
) -> AsyncIterator[Emit]:
    """Engine chunks -> OpenAI ``chat.completion.chunk`` events (token ids kept in meta),
    each under its choice's index, with its tokens' logprobs when asked for.

    ``roles``: the choices whose first chunk is still to be sent; as vLLM, that chunk is the
    first token's, with the assistant role in its delta (so a client that times the first
    chunk times the first token); a choice that ends with no token gets the role alone first.
    ``stream_options``: ``include_usage`` adds a final usage-only chunk (OpenAI; with
    ``n`` > 1 once, after every choice finished, completion tokens summed), with the request's
    ``metrics`` when ``timed`` (``timings.py``); ``continuous_usage_stats`` puts the running
    usage on every content chunk too (vLLM). ``ended``: choices of a continued stream that had
    finished before it stopped, with their completion tokens (they count in the usage chunk
    but produce nothing more); ``sent``: what its stored events already say (their cache
    hits count in the usage chunk).
    """
    include_usage = bool(options and options.include_usage)
    running = bool(options and options.continuous_usage_stats)
    roles = set(roles)
    counts, finished = Usage(completion=dict(ended or {})), len(ended or {})
    timings: dict[str, float] | None = None
    if sent is not None and sent.cached_tokens is not None:
        counts.cached, counts.cached_known = sent.cached_tokens, True
    cache_noted = sent is not None  # the stream's cache hits go in its first chunk's meta
    async for c in chunks:
        counts.add(c)
        ending = _ending(c)  # in the meta: a stream cut right here is ended on resume
        if not cache_noted and c.cached_tokens is not None and c.index == 0:
            ending, cache_noted = {"cached_tokens": c.cached_tokens, **ending}, True
        if c.text or c.token_ids or c.reasoning or c.tool_calls:
            now = usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens) if running else None
            delta = delta_of(c.text, c.reasoning, c.tool_calls) or {"content": ""}
            if c.index in roles:
                roles.discard(c.index)
                delta = {**_ROLE, **delta}
            content = choice_chunk(ids, c.index, delta, usage_=now, logprobs=c.logprobs)
            yield Emit(content, meta={"token_ids": c.token_ids, **ending})
        if c.finish_reason is not None:
            if c.index in roles:
                roles.discard(c.index)
                yield Emit(choice_chunk(ids, c.index, {**_ROLE, "content": ""}))
            finished += 1
            timings = c.timings if c.index == 0 else timings
            yield Emit(choice_chunk(ids, c.index, {}, c.finish_reason.value), meta=ending)
            if include_usage and finished >= n:
                metrics = _metrics(timings, counts) if timed else None
                yield Emit(choice_chunk(ids, 0, None, usage_=counts.body(), metrics=metrics))


def _metrics(timings: dict[str, float] | None, counts: Usage) -> dict[str, Any] | None:
    """The ``metrics`` of a single-choice answer (None: not timed)."""
    if timings is None or len(counts.completion) != 1:
        return None
    return metrics_object(timings, counts.completion.get(0, 0))


def _ending(chunk: Chunk) -> dict[str, Any]:
    """How a choice ended (stored with its last chunks; nothing while it goes on)."""
    if chunk.finish_reason is None:
        return {}
    return {
        "finish_reason": chunk.finish_reason.value,
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "cached_tokens": chunk.cached_tokens,
    }


async def _leased(leases: list[Leased], emits: AsyncIterator[Emit]) -> AsyncIterator[Emit]:
    """Hold the model leases for as long as the stream produces (no idle unload meanwhile)."""
    try:
        async for emit in emits:
            yield emit
    finally:
        for lease in leases:
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


class ChatService:
    def __init__(
        self,
        models: ModelManager,
        converter: Converter,
        sessions: SessionManager,
        metrics: Metrics | None = None,
        keys: KeyPolicy | None = None,
        per_request_metrics: bool = False,
    ):
        self.models = models
        self.converter = converter
        self.sessions = sessions
        self.metrics = metrics
        self.keys = keys or KeyPolicy()
        self.per_request_metrics = per_request_metrics  # every answer carries its timings
        sessions.set_resumer(self.resume)

    def timed(self, body: ChatCompletionRequest) -> bool:
        """Whether the answer carries its ``metrics`` (single-choice answers only, as vLLM)."""
        wanted = self.per_request_metrics if body.include_metrics is None else body.include_metrics
        return wanted and body.n == 1

    async def open_generation(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        *,
        model: str | None = None,
        resume_after: list[int] | None = None,
        priority: int = INTERACTIVE_PRIORITY,
        owner: str = ANONYMOUS,
    ) -> Generation:
        """Lease, admit and prepare one generation (``generation.open_generation``)."""
        return await open_generation(
            self.models,
            self.converter,
            self.metrics,
            body,
            request_id,
            model=model,
            resume_after=resume_after,
            priority=priority,
            owner=owner,
            keys=self.keys,
        )

    async def complete(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        *,
        priority: int = INTERACTIVE_PRIORITY,
        owner: str = ANONYMOUS,
    ) -> dict[str, Any]:
        answer, _ = await self.complete_timed(body, request_id, priority=priority, owner=owner)
        return answer

    async def complete_timed(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        *,
        priority: int = INTERACTIVE_PRIORITY,
        owner: str = ANONYMOUS,
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        """The ``chat.completion`` (with its ``metrics`` when ``timed``) and its timings."""
        generation = await self.open_generation(body, request_id, priority=priority, owner=owner)
        answer = Answer()
        try:
            async for chunk in generation.chunks:
                answer.add(chunk)
        finally:
            generation.release_place()
            generation.lease.release()
        out = answer.body(_new_ids(generation.model_id))
        if self.timed(body) and answer.timings is not None:
            out["metrics"] = metrics_object(answer.timings, out["usage"]["completion_tokens"])
        return out, answer.timings

    async def start_stream(
        self, body: ChatCompletionRequest, request_id: str, owner: str = ANONYMOUS
    ) -> tuple[str, str]:
        """Validate and prepare (4xx before any byte is sent), then start the session in
        ``owner``'s namespace; its id and resume token (``resume_token.py``)."""
        session_id, tenant = body.session_id or uuid.uuid4().hex, tenant_of(owner)
        if body.session_id and await self.sessions.exists(session_id, tenant):
            raise InvalidRequest(
                f"session {session_id!r} already exists; resume it with a Last-Event-ID header "
                "or start a new one with another session_id",
                param="session_id",
                code="session_exists",
            )
        body = seeded(body, self.sessions.durable)
        generation = await self.open_generation(body, request_id, owner=owner)
        token, token_alias = issue()
        try:
            ids = _new_ids(generation.model_id)
            record = {
                "body": body.model_dump(mode="json"),
                "id": ids.id,
                "created": ids.created,
                "model": ids.model,
                "api_owner": owner,
            }
            emits = _emits(
                generation.chunks,
                ids,
                body.stream_options,
                set(range(body.n)),
                n=body.n,
                timed=self.timed(body),
            )
            await self.sessions.start(
                session_id,
                record,
                _leased([generation.lease], emits),
                on_cancel=_on_cancel(ids),
                on_error=_on_error,
                aliases=[ids.id],
                tenant=tenant,
                secret_aliases=[token_alias],
            )
        except BaseException:
            await generation.abandon()
            raise
        return session_id, token

    async def resume(self, record: SessionRecord, events: list[Event]) -> Resumption | None:
        """After a restart: continue a stored generation after exactly the tokens already sent
        (the SessionManager's resumer; None when it cannot be continued). An ``n`` > 1 stream
        goes on choice by choice (``engine/choices.py``); one whose choices had all ended gets
        only what was left to send (the usage chunk)."""
        stored = record.request
        try:
            body = ChatCompletionRequest.model_validate(stored["body"])
            ids = CompletionIds(id=stored["id"], created=stored["created"], model=stored["model"])
            sent = sent_by_choice(events)
            finishes = _unsent_finishes(ids, sent)
            if sent.ended(body.n):
                emits = _replay([*finishes, *_usage_owed(ids, body.stream_options, sent)])
                return Resumption(producer=emits, on_cancel=_on_cancel(ids), on_error=_on_error)
            opened = await self._reopen(record, body, events, sent)
        except (KeyError, VlmserveError, ValueError) as exc:
            log.warning("cannot continue session %s: %s", record.session_id, exc)
            return None
        chunks = (
            opened[0][1].chunks
            if body.n == 1
            else merge_choices([(i, generation.chunks) for i, generation in opened])
        )
        emits = _replay(
            finishes,
            _emits(
                chunks,
                ids,
                body.stream_options,
                {i for i in range(body.n) if i not in sent.tokens},
                n=body.n,
                ended=sent.completion,
                timed=self.timed(body),
                sent=sent,
            ),
        )
        leases = [generation.lease for _, generation in opened]
        return Resumption(
            producer=_leased(leases, emits), on_cancel=_on_cancel(ids), on_error=_on_error
        )

    async def _reopen(
        self,
        record: SessionRecord,
        body: ChatCompletionRequest,
        events: list[Event],
        sent: SentChoices,
    ) -> list[tuple[int, Generation]]:
        """Each unfinished choice as a generation of its own: ``n`` = 1 as stored; for ``n`` > 1
        ``n`` = 1, ``seed + i`` and that choice's own tokens as the prefix."""
        if body.n == 1:
            generation = await self.open_generation(
                body,
                f"resume-{record.session_id}",
                model=record.request["model"],
                resume_after=sent_token_ids(events),
                owner=_owner(record),
            )
            return [(0, generation)]

        async def open_one(i: int) -> Generation:
            seed = None if body.seed is None else body.seed + i
            return await self.open_generation(
                body.model_copy(update={"n": 1, "seed": seed}),
                f"resume-{record.session_id}-choice{i}",
                model=record.request["model"],
                resume_after=sent.tokens.get(i, []),
                owner=_owner(record),
            )

        return await open_choices(body.n, sent.completion, open_one, Generation.abandon)


def _owner(record: SessionRecord) -> str:
    return str(record.request.get("api_owner", ANONYMOUS))


def _unsent_finishes(ids: CompletionIds, sent: SentChoices) -> list[Emit]:
    """The finish chunks of choices that had ended (their last text chunk was stored, with
    how they end in its meta) when the stream was cut, in index order."""
    return [
        Emit(
            choice_chunk(ids, i, {}, reason),
            meta={
                "finish_reason": reason,
                "prompt_tokens": sent.prompt_tokens,
                "completion_tokens": sent.completion[i],
            },
        )
        for i, reason in sorted(sent.unsent_finish.items())
    ]


def _usage_owed(ids: CompletionIds, options: StreamOptions | None, sent: SentChoices) -> list[Emit]:
    """What a stream whose choices had all ended still owes: its usage chunk, when asked for
    and not stored yet (``ValueError`` when the stored events lack the prompt's count)."""
    if not (options and options.include_usage) or sent.usage_sent:
        return []
    if sent.prompt_tokens is None:
        raise ValueError("the stored finish chunks do not carry the token counts")
    counts = usage(sent.prompt_tokens, sum(sent.completion.values()), sent.cached_tokens)
    return [Emit(choice_chunk(ids, 0, None, usage_=counts))]


async def _replay(head: list[Emit], rest: AsyncIterator[Emit] | None = None) -> AsyncIterator[Emit]:
    """``head``, then what ``rest`` yields."""
    for emit in head:
        yield emit
    if rest is not None:
        async for emit in rest:
            yield emit
