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
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from vlmserve.api.metrics import Metrics
from vlmserve.api.protocol.chat import ChatCompletionRequest
from vlmserve.api.serving.convert import Converter, response_format
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import INTERACTIVE_PRIORITY, Chunk, GenerateRequest, Serves
from vlmserve.errors import UnsupportedFeature
from vlmserve.registry.manager import Lease, ModelManager

__all__ = ["Generation", "open_generation", "sent_by_choice", "sent_token_ids"]


@dataclass(slots=True)
class Generation:
    """A prepared generation: its chunks start flowing when first iterated (which hands the
    queue place over to the engine). Whoever takes it releases ``lease`` when done."""

    lease: Lease
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


def sent_token_ids(events: list[Any]) -> list[int]:
    """The token ids a stored stream's events carry (what a client already has)."""
    return [t for e in events if e.meta for t in e.meta.get("token_ids", [])]


def sent_by_choice(events: list[Any]) -> tuple[dict[int, list[int]], set[int]]:
    """An ``n`` > 1 stream's stored events: the token ids each choice has sent (by index) and
    the choices that already ended (their ``finish_reason`` chunk was sent)."""
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    for event in events:
        choice = _first_choice(event.data)
        if choice is None:
            continue
        index = int(choice.get("index", 0))
        tokens.setdefault(index, []).extend((event.meta or {}).get("token_ids", []))
        if choice.get("finish_reason") is not None:
            finished.add(index)
    return tokens, finished


def _first_choice(data: str) -> dict[str, Any] | None:
    """The one choice of a ``chat.completion.chunk`` event (None: another kind of event)."""
    try:
        choices = json.loads(data).get("choices")
    except (ValueError, AttributeError):
        return None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return choices[0]


async def open_generation(
    models: ModelManager, converter: Converter, metrics: Metrics | None,
    body: ChatCompletionRequest, request_id: str, *, model: str | None = None,
    resume_after: list[int] | None = None, priority: int = INTERACTIVE_PRIORITY,
) -> Generation:  # fmt: skip
    """Lease, admit and prepare (every 4xx/429/503 raises here). ``resume_after``: tokens an
    earlier run already sent; the engine continues after them (``ValueError`` for a proxied
    model, whose tokens are the upstream's). ``priority``: the engine's admission class
    (``BATCH_PRIORITY`` for batch lines)."""
    needs = converter.needs(body)
    lease = await models.acquire(model or body.model, "chat", Serves.CHAT, needs)
    prepared, release = None, _nothing
    try:
        backend = lease.backend
        if resume_after is not None and backend.proxied:
            raise ValueError("a proxied generation cannot continue after a restart")
        release = backend.admit()  # a full queue is a 429 now, not an event in a 200 stream
        request = await _engine_request(converter, backend, body, request_id)
        request.prefix_token_ids = list(resume_after or [])
        request.priority = priority
        prepared = await backend.prepare(request)
    except BaseException:
        release()
        if prepared is not None:
            await lease.backend.discard(prepared)
        lease.release()
        raise
    chunks = _observed(backend.generate(prepared), metrics, backend.model_id)
    return Generation(lease, prepared, _admitted(release, chunks), release)


async def _engine_request(converter: Converter, backend: Backend, body: ChatCompletionRequest,
                          request_id: str) -> GenerateRequest:  # fmt: skip
    """The engine request. A proxied model gets the wire body as is: its media are neither
    fetched nor decoded here (only ``Converter.check``'s limits apply)."""
    if not backend.proxied:
        return await converter.to_request(body, request_id)
    converter.check(body)
    if body.n > 1 or body.logprobs:  # the upstream wire reads back one choice, no logprobs
        raise UnsupportedFeature(
            f"{'n > 1' if body.n > 1 else 'logprobs'} is not supported for the proxied model "
            f"{backend.model_id!r} yet",
            param="n" if body.n > 1 else "logprobs",
        )
    return GenerateRequest(
        request_id, [], converter.sampling(body), response_format=response_format(body),
        raw=body.model_dump(mode="json", exclude_unset=True),
    )  # fmt: skip


def _nothing() -> None:
    pass


async def _admitted(
    release: Callable[[], None], chunks: AsyncIterator[Chunk]
) -> AsyncIterator[Chunk]:
    """Hand the reserved queue place over as the engine takes the request (no await between)."""
    release()
    async for chunk in chunks:
        yield chunk


async def _observed(
    chunks: AsyncIterator[Chunk], metrics: Metrics | None, model: str
) -> AsyncIterator[Chunk]:
    """Pass chunks through, recording time to first token, token counts and duration."""
    started, first = time.perf_counter(), None
    async for chunk in chunks:
        if first is None and (chunk.token_ids or chunk.text or chunk.reasoning):
            first = time.perf_counter() - started
        if chunk.finish_reason is not None and metrics is not None:
            total = time.perf_counter() - started
            metrics.observe_generation(
                model, prompt_tokens=chunk.prompt_tokens, output_tokens=chunk.completion_tokens,
                ttft=total if first is None else first, total=total,
            )  # fmt: skip
        yield chunk
