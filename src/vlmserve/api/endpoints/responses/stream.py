"""Engine chunks -> a response's events. The generation itself is opened like every chat
generation (``ChatService.open_generation``: lease, queue place, prepare, metrics)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.generation import Generation, sent_token_ids
from vlmserve.api.common.timings import metrics_object
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.chat.service import ChatService
from vlmserve.api.endpoints.responses.objects import ResponseLog
from vlmserve.streaming import Emit, Event, Resumption

__all__ = ["produce", "resumption"]


async def produce(
    log: ResponseLog, generation: Generation, timed: bool = False
) -> AsyncIterator[Emit]:
    """The response's events; the model lease is held until the last one. ``timed``: the
    final response carries the request's ``metrics`` (``timings.py``)."""
    try:
        for emit in log.preamble():
            yield emit
        pending: list[int] = []  # ids of text the detokenizer still holds
        # A continued response reports the cache hits of the request as the client sent it
        # (kept in the meta of its first stored event), not those of the continuation's prompt.
        restored, cached_noted = log.cached_tokens, log.cached_tokens is not None
        async for chunk in generation.chunks:
            if restored is not None:
                chunk = replace(chunk, cached_tokens=restored)
            pending.extend(chunk.token_ids)
            emits = log.think(chunk.reasoning, pending) if chunk.reasoning else []
            if chunk.text:
                emits += log.delta(chunk.text, [] if emits else pending)
            if emits:
                pending = []
            if chunk.finish_reason is not None:  # a stream cut after its text ends on resume
                closing = {"closing": log.ending(chunk)}
                emits = [replace(e, meta={**(e.meta or {}), **closing}) for e in emits]
                if timed and chunk.timings is not None:
                    log.metrics = metrics_object(chunk.timings, chunk.completion_tokens)
                emits += log.finish(chunk)
            if emits and not cached_noted and chunk.cached_tokens is not None:
                cached = {"cached_tokens": chunk.cached_tokens}
                emits[0] = replace(emits[0], meta={**(emits[0].meta or {}), **cached})
                cached_noted = True
            for emit in emits:
                yield emit
    finally:
        generation.lease.release()


async def resumption(
    chat: ChatService, request: dict[str, Any], events: list[Event], session_id: str
) -> Resumption:
    """Continue a stored response after a restart, after exactly the tokens already sent (or,
    cut short while ending, with the closing events it had not stored yet)."""
    log = ResponseLog.restore(request, events)
    if log.closing is not None or log.final is not None:
        return Resumption(_replay(log.end_again()), log.on_cancel, log.on_error)
    body = ChatCompletionRequest.model_validate(request["body"])
    generation = await chat.open_generation(
        body,
        f"resume-{session_id}",
        resume_after=sent_token_ids(events),
        owner=request.get("api_owner", ANONYMOUS),
    )
    return Resumption(produce(log, generation), log.on_cancel, log.on_error)


async def _replay(emits: list[Emit]) -> AsyncIterator[Emit]:
    for emit in emits:
        yield emit
