"""``LogprobsBackend``: a chat backend with no model that answers at once, for tests of what the
server does with a large answer (building, serialising and sending it), not of generation.

Each request gets ``n`` choices of ``max_tokens`` tokens (``ignore_eos`` or not), each token
with its logprob and ``top_logprobs`` alternatives when asked, in the shapes a real backend
yields: one ``Chunk`` per token and choice (``index`` = the choice), a last one per choice
with its finish reason and counts. It yields to the event loop after every step, as a backend
whose tokens come from an engine thread does, so the loop stays free while the answer grows.
Torch-free; served by ``python -m vlmserve.testing.scripted_server``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import (
    Chunk,
    FinishReason,
    GenerateRequest,
    ModelState,
    SamplingParams,
    Serves,
)

__all__ = ["LogprobsBackend", "logprob_item"]

_PROMPT_TOKENS = 8


def _token(step: int, rank: int) -> str:
    return f" word{(step * 31 + rank * 7) % 5000:04d}"


def logprob_item(step: int, alternatives: int) -> dict[str, Any]:
    """OpenAI's ``logprobs.content`` item of step ``step`` with ``alternatives`` top tokens."""
    top = [
        {
            "token": _token(step, rank),
            "logprob": -0.125 * (rank + 1),
            "bytes": list(_token(step, rank).encode()),
        }
        for rank in range(alternatives)
    ]
    token = _token(step, 0)
    return {"token": token, "logprob": -0.125, "bytes": list(token.encode()), "top_logprobs": top}


class LogprobsBackend(Backend):
    """The chat backend of the module docstring, ready as soon as it is made."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.serves = Serves.CHAT
        self.state = ModelState.READY
        self.error: str | None = None
        self.load_seconds: float | None = 0.0

    async def aload(self) -> None:
        self.state = ModelState.READY

    async def aclose(self) -> None:
        self.state = ModelState.UNLOADED

    def close(self) -> None:
        self.state = ModelState.UNLOADED

    async def prepare(self, request: GenerateRequest) -> SamplingParams:
        return request.sampling

    async def generate(self, prepared: SamplingParams) -> AsyncIterator[Chunk]:
        sampling = prepared
        alternatives = sampling.top_logprobs if sampling.logprobs else 0
        for step in range(sampling.max_tokens):
            item = logprob_item(step, alternatives) if sampling.logprobs else None
            for index in range(sampling.n):
                yield Chunk(
                    _token(step, 0),
                    [step],
                    prompt_tokens=_PROMPT_TOKENS,
                    completion_tokens=step + 1,
                    logprobs=None if item is None else [item],
                    index=index,
                )
            await asyncio.sleep(0)
        for index in range(sampling.n):
            yield Chunk(
                "",
                [],
                FinishReason.LENGTH,
                _PROMPT_TOKENS,
                sampling.max_tokens,
                index=index,
            )
