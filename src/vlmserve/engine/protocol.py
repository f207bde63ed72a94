"""The one interface between the API and a model backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from vlmserve.engine.types import Chunk, GenerateRequest

__all__ = ["ChatBackend"]


class ChatBackend(Protocol):
    """A backend that generates text for chat messages (images and video included).

    ``prepare`` does everything that can fail because of the input (template, processor,
    context length) so the API can answer 4xx before a stream starts. ``generate`` is an
    async generator: closing it early (``aclose``, or cancelling the task iterating it)
    stops the generation within one decode step.
    """

    model_id: str

    async def prepare(self, request: GenerateRequest) -> Any: ...

    def generate(self, prepared: Any) -> AsyncIterator[Chunk]: ...
