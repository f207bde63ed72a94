"""Engine chunks -> a response's events. The generation itself is opened like every chat
generation (``ChatService.open_generation``: lease, queue place, prepare, metrics)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vlmserve.api.protocol.chat import ChatCompletionRequest
from vlmserve.api.serving.chat import ChatService
from vlmserve.api.serving.generation import Generation, sent_token_ids
from vlmserve.api.serving.responses_objects import ResponseLog
from vlmserve.streaming import Emit, Event, Resumption

__all__ = ["produce", "resumption"]


async def produce(log: ResponseLog, generation: Generation) -> AsyncIterator[Emit]:
    """The response's events; the model lease is held until the last one."""
    try:
        for emit in log.preamble():
            yield emit
        pending: list[int] = []  # ids of text the detokenizer still holds
        async for chunk in generation.chunks:
            pending.extend(chunk.token_ids)
            emits = log.think(chunk.reasoning, pending) if chunk.reasoning else []
            if chunk.text:
                emits += log.delta(chunk.text, [] if emits else pending)
            if emits:
                pending = []
            for emit in emits:
                yield emit
            if chunk.finish_reason is not None:
                for emit in log.finish(chunk):
                    yield emit
    finally:
        generation.lease.release()


async def resumption(chat: ChatService, request: dict[str, Any], events: list[Event],
                     session_id: str) -> Resumption:  # fmt: skip
    """Continue a stored response after a restart, after exactly the tokens already sent."""
    body = ChatCompletionRequest.model_validate(request["body"])
    generation = await chat.open_generation(body, f"resume-{session_id}",
                                            resume_after=sent_token_ids(events))  # fmt: skip
    log = ResponseLog.restore(request, events)
    return Resumption(produce(log, generation), log.on_cancel, log.on_error)
