"""One generation, opened the same way for every API that runs the chat model.

``open_generation`` does everything that can fail before a byte is sent: the model lease (404,
wrong kind, missing capability, 503 while loading), a queue place (429 when full), the engine
request (media fetched and decoded here for a local model; the wire body as is for a proxied
one) and ``backend.prepare`` (template, processor, context length, grammar). What it returns
streams chunks with the generation metrics recorded. Chat completions (JSON and streams), the
Responses API and the task endpoints all go through it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.convert import Converter, response_format
from vlmserve.api.common.keys import KeyedLease, KeyPolicy
from vlmserve.api.common.timings import RequestClock
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.metrics import Metrics
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import INTERACTIVE_PRIORITY, Chunk, GenerateRequest, Serves
from vlmserve.errors import UnsupportedFeature
from vlmserve.gateway.media_routes import scoped_uuids
from vlmserve.media.workers import hand_over
from vlmserve.registry.manager import ModelManager

__all__ = [
    "Generation",
    "Leased",
    "SentChoices",
    "open_generation",
    "seeded",
    "sent_by_choice",
    "sent_token_ids",
]


class Leased(Protocol):
    """A generation's hold on its model (a registry ``Lease``, with its key's place)."""

    @property
    def backend(self) -> Backend: ...

    def release(self) -> None: ...


@dataclass(slots=True)
class Generation:
    """A prepared generation: its chunks start flowing when first iterated (which hands the
    queue place over to the engine). Whoever takes it releases ``lease`` when done."""

    lease: Leased
    prepared: Any
    chunks: AsyncIterator[Chunk]
    release_place: Callable[[], None]

    @property
    def model_id(self) -> str:
        return self.lease.backend.model_id

    async def abandon(self) -> None:
        """Undo everything when the chunks are never run (the session did not start)."""
        self.release_place()
        await self.lease.backend.discard(self.prepared)
        self.lease.release()


def seeded(body: ChatCompletionRequest, durable: bool) -> ChatCompletionRequest:
    """The body with a random seed when it has none and its stream is stored: a restarted
    server then continues a sampled stream as this run would have (the seed is stored with
    the request body in the session record)."""
    if body.seed is not None or not durable:
        return body
    return body.model_copy(update={"seed": secrets.randbits(63)})


def sent_token_ids(events: list[Any]) -> list[int]:
    """The token ids a stored stream's events carry (what a client already has)."""
    return [t for e in events if e.meta for t in e.meta.get("token_ids", [])]


@dataclass(slots=True)
class SentChoices:
    """What a stored stream's events say about its choices (``sent_by_choice``)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)  # token ids sent, by index
    completion: dict[int, int] = field(default_factory=dict)  # ended choices: their tokens
    prompt_tokens: int | None = None  # from a finish chunk's meta (None: not stored)
    cached_tokens: int | None = None  # from the first chunk's meta (None: no prefix cache)
    usage_sent: bool = False  # the usage-only chunk was stored
    unsent_finish: dict[int, str] = field(default_factory=dict)  # ended; finish chunk not stored

    def ended(self, n: int) -> bool:
        return len(self.completion) >= n


def sent_by_choice(events: list[Any]) -> SentChoices:
    """A stored stream's events: the token ids each choice has sent (by index), the choices
    that already ended (their ``finish_reason`` chunk was sent, with the counts ``_emits``
    keeps in its meta) and whether the final usage chunk went out."""
    sent = SentChoices()
    for event in events:
        chunk = _chunk(event.data)
        choices = chunk.get("choices") if chunk else None
        if not isinstance(choices, list):
            continue
        if not choices:
            sent.usage_sent = sent.usage_sent or bool(chunk and chunk.get("usage"))
            continue
        _fold(sent, int(choices[0].get("index", 0)), choices[0].get("finish_reason"), event.meta)
    return sent


def _fold(sent: SentChoices, index: int, finish: str | None, meta: dict[str, Any] | None) -> None:
    """One stored chunk of choice ``index``: its tokens, and whether it ended (its finish
    chunk, or the last text chunk whose meta says how the choice ends)."""
    meta = meta or {}
    sent.tokens.setdefault(index, []).extend(meta.get("token_ids", []))
    if meta.get("cached_tokens") is not None:  # the first chunk's, and the finishes'
        sent.cached_tokens = meta["cached_tokens"]
    reason = finish or meta.get("finish_reason")
    if reason is None:
        return
    sent.completion[index] = int(meta.get("completion_tokens", len(sent.tokens[index])))
    sent.prompt_tokens = meta.get("prompt_tokens", sent.prompt_tokens)
    if finish is None:
        sent.unsent_finish[index] = reason
    else:
        sent.unsent_finish.pop(index, None)


def _chunk(data: str) -> dict[str, Any] | None:
    """A ``chat.completion.chunk`` event's JSON (None: another kind of event)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if not isinstance(chunk, dict):
        return None
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and not isinstance(choices[0], dict):
        return None
    return chunk


async def open_generation(
    models: ModelManager,
    converter: Converter,
    metrics: Metrics | None,
    body: ChatCompletionRequest,
    request_id: str,
    *,
    model: str | None = None,
    resume_after: list[int] | None = None,
    priority: int = INTERACTIVE_PRIORITY,
    owner: str = ANONYMOUS,
    keys: KeyPolicy | None = None,
) -> Generation:
    """Lease, admit and prepare (every 4xx/429/503 raises here). ``resume_after``: tokens an
    earlier run already sent; the engine continues after them (``ValueError`` for a proxied
    model, whose tokens are the upstream's). ``priority``: the engine's admission class
    (``BATCH_PRIORITY`` for batch lines). ``owner``'s key salts the prefix cache and holds one
    of its places (``keys.py``; a continued generation or a batch line takes none: batches
    have their own concurrency)."""
    clock = RequestClock()
    needs = converter.needs(body)
    keys = keys or KeyPolicy()
    interactive = resume_after is None and priority == INTERACTIVE_PRIORITY
    place = keys.take(owner) if interactive else _nothing
    try:
        held = await models.acquire(model or body.model, "chat", Serves.CHAT, needs)
    except BaseException:
        place()
        raise
    lease = KeyedLease(held, place)
    prepared, release = None, _nothing
    try:
        backend = lease.backend
        if resume_after is not None and backend.proxied:
            raise ValueError("a proxied generation cannot continue after a restart")
        release = backend.admit()  # a full queue is a 429 now, not an event in a 200 stream
        request = await _engine_request(converter, backend, body, request_id, owner)
        request.prefix_token_ids = list(resume_after or [])
        request.priority = priority
        if not backend.proxied:
            request.cache_salt = keys.salt(owner, request.cache_salt)
        prepared = await backend.prepare(request)
        clock.prepared = time.perf_counter()
        hand_over()  # the engine holds the media now: their bytes leave the media budget
    except BaseException:
        release()
        if prepared is not None:
            await lease.backend.discard(prepared)
        lease.release()
        raise
    asked = _Asked(body.max_tokens or 0, body.n)
    chunks = _observed(backend.generate(prepared), metrics, backend.model_id, clock, asked)
    return Generation(lease, prepared, _admitted(release, chunks), release)


async def _engine_request(
    converter: Converter,
    backend: Backend,
    body: ChatCompletionRequest,
    request_id: str,
    owner: str = ANONYMOUS,
) -> GenerateRequest:
    """The engine request: media decoded by the model's frame rule, ``owner``'s media uuids.
    A proxied model gets the wire body as is: its media are neither fetched nor decoded here
    (only ``Converter.check``'s limits apply)."""
    if not backend.proxied:
        sampling = backend.video_sampling()
        return await converter.to_request(body, request_id, sampling=sampling, owner=owner)
    converter.check(body)
    if body.n > 1 or body.logprobs:  # the upstream wire reads back one choice, no logprobs
        raise UnsupportedFeature(
            f"{'n > 1' if body.n > 1 else 'logprobs'} is not supported for the proxied model "
            f"{backend.model_id!r} yet",
            param="n" if body.n > 1 else "logprobs",
        )
    raw = scoped_uuids(body.model_dump(mode="json", exclude_unset=True), owner)
    return GenerateRequest(
        request_id, [], converter.sampling(body), response_format=response_format(body), raw=raw
    )


def _nothing() -> None:
    pass


async def _admitted(
    release: Callable[[], None], chunks: AsyncIterator[Chunk]
) -> AsyncIterator[Chunk]:
    """Hand the reserved queue place over as the engine takes the request (no await between)."""
    release()
    async for chunk in chunks:
        yield chunk


@dataclass(slots=True, frozen=True)
class _Asked:
    """What the request asked for, as vLLM's histograms of request parameters count it."""

    max_tokens: int
    n: int


async def _observed(
    chunks: AsyncIterator[Chunk],
    metrics: Metrics | None,
    model: str,
    clock: RequestClock,
    asked: _Asked,
) -> AsyncIterator[Chunk]:
    """Pass chunks through, recording time to first token, token counts and duration; a
    finish chunk leaves with the request's timings (``timings.py``)."""
    started, first = time.perf_counter(), None
    async for chunk in chunks:
        now = time.perf_counter()
        tokens = len(chunk.token_ids)
        if tokens or chunk.text or chunk.reasoning:
            gap = clock.tokens(now)
            if first is None:
                first = now - started
            elif metrics is not None and tokens:
                metrics.observe_inter_token(model, gap, tokens)
        if chunk.finish_reason is not None:
            chunk.timings = clock.phases(chunk.timings, now)
            if metrics is not None:
                _record(metrics, model, chunk, clock, asked, now, started, first)
        yield chunk


def _record(
    metrics: Metrics,
    model: str,
    chunk: Chunk,
    clock: RequestClock,
    asked: _Asked,
    now: float,
    started: float,
    first: float | None,
) -> None:
    """One finished choice, under our names and vLLM's."""
    total = now - started
    metrics.observe_generation(
        model,
        prompt_tokens=chunk.prompt_tokens,
        output_tokens=chunk.completion_tokens,
        ttft=total if first is None else first,
        total=total,
    )
    done = {
        "prompt_tokens": chunk.prompt_tokens,
        "output_tokens": chunk.completion_tokens,
        "finish_reason": chunk.finish_reason.value if chunk.finish_reason else "error",
        "max_tokens": asked.max_tokens or chunk.completion_tokens,
        "n": asked.n,
        "ttft": clock.time_to_first_token(now),
        "timings": chunk.timings,
    }
    metrics.observe_finished(model, done)
