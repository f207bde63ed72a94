"""The GPU worker's task endpoints and ``/v1/embeddings``, on the models picked by role."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from vlmserve.api.common.convert import Converter
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.embeddings.protocol import EmbeddingsRequest
from vlmserve.api.endpoints.worker.protocol import CaptionRequest, GenerateRequestIn
from vlmserve.engine.protocol import Backend, as_proxied
from vlmserve.engine.types import (
    ChatMessage,
    EmbedInput,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    Serves,
    TextPart,
    VideoPart,
)
from vlmserve.errors import InvalidRequest, VlmserveError
from vlmserve.registry.manager import EMBEDDING, ModelManager

__all__ = ["CAPTION_INSTRUCTION", "WorkerService", "caption_messages"]

CAPTION_INSTRUCTION = "Describe what happens in this video clip in detail."


def caption_messages(frames: list[Any], transcript: str | None) -> list[ChatMessage]:
    """The caption prompt: the clip's frames, the transcript as context, the instruction."""
    text = CAPTION_INSTRUCTION
    if transcript and transcript.strip():
        text = f"Audio transcript of this clip:\n{transcript.strip()}\n\n{CAPTION_INSTRUCTION}"
    return [ChatMessage("user", [VideoPart(frames=frames), TextPart(text)])]


def _truncate(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    if dimensions is None:
        return vectors
    if dimensions > vectors.shape[1]:
        raise InvalidRequest(
            f"dimensions={dimensions} is larger than the model's {vectors.shape[1]}",
            param="dimensions",
        )
    cut = vectors[:, :dimensions]  # Matryoshka-style: truncate, then renormalise
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()


class WorkerService:
    """Each call leases its model through the manager; a proxied model answers the same
    endpoint upstream (``Proxied.relay``), a local one here."""

    def __init__(self, models: ModelManager, converter: Converter):
        self.models = models
        self.converter = converter

    async def frames(self, frames: list[str]) -> list[Any]:
        try:
            return await self.converter.frames(frames)
        except VlmserveError as exc:
            exc.param = exc.param or "frames"
            raise

    async def encode_video(self, frames: list[str], model: str | None) -> list[float]:
        if not frames:
            await self.frames(frames)  # the 400, before a model is picked
        async with await self.models.acquire(model, EMBEDDING, Serves.EMBEDDING) as backend:
            if (proxied := as_proxied(backend)) is not None:
                return (await proxied.relay("/encode-video", {"frames": frames}))["embedding"]
            decoded = await self.frames(frames)
            return (await backend.embed([EmbedInput(frames=decoded)]))[0].tolist()

    async def encode_text(self, text: str, model: str | None) -> list[float]:
        if not text.strip():
            raise InvalidRequest("text is empty", param="text")
        async with await self.models.acquire(model, EMBEDDING, Serves.EMBEDDING) as backend:
            if (proxied := as_proxied(backend)) is not None:
                return (await proxied.relay("/encode-text", {"text": text}))["embedding"]
            return (await backend.embed([EmbedInput(text=text)]))[0].tolist()

    async def _run(self, backend: Backend, request: GenerateRequest) -> str:
        prepared = await backend.prepare(request)
        return "".join([chunk.text async for chunk in backend.generate(prepared)])

    async def caption(self, body: CaptionRequest) -> str:
        if not body.frames:
            await self.frames(body.frames)
        async with await self.models.acquire(body.model, "caption", Serves.CHAT) as backend:
            wire = body.model_dump(mode="json", exclude_unset=True)
            if (proxied := as_proxied(backend)) is not None:
                return (await proxied.relay("/caption", wire))["caption"]
            frames = await self.frames(body.frames)
            sampling = SamplingParams(max_tokens=body.max_new_tokens, temperature=0.0)
            messages = caption_messages(frames, body.transcript)
            request = GenerateRequest(uuid.uuid4().hex, messages, sampling)
            return await self._run(backend, request)

    async def generate(self, body: GenerateRequestIn) -> str:
        async with await self.models.acquire(body.model, "chat", Serves.CHAT) as backend:
            wire = body.model_dump(mode="json", exclude_unset=True)
            if (proxied := as_proxied(backend)) is not None:
                return (await proxied.relay("/generate", wire))["text"]
            chat = ChatCompletionRequest(
                model=backend.model_id,
                messages=body.messages,
                max_tokens=body.max_new_tokens,
                temperature=body.temperature,
            )
            sampling = backend.video_sampling()  # the family's frames, as on chat
            request = await self.converter.to_request(chat, uuid.uuid4().hex, sampling=sampling)
            return await self._run(backend, request)

    async def embeddings(self, body: EmbeddingsRequest) -> dict[str, Any]:
        async with await self.models.acquire(body.model, EMBEDDING, Serves.EMBEDDING) as backend:
            wire = body.model_dump(mode="json", exclude_unset=True)
            if (proxied := as_proxied(backend)) is not None:
                return {**await proxied.relay("/v1/embeddings", wire), "model": backend.model_id}
            items = await self._items(body, backend)
            vectors = _truncate(await backend.embed(items), body.dimensions)
            tokens = backend.count_tokens(items)
            model_id = backend.model_id
        return {
            "object": "list",
            "model": model_id,
            "data": [
                {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def _items(self, body: EmbeddingsRequest, backend: Backend) -> list[EmbedInput]:
        if body.messages is not None:
            return [await self._multimodal_item(body)]
        if body.token_arrays is not None:
            texts = await backend.decode_tokens(body.token_arrays)
            return [EmbedInput(text=t) for t in texts]
        return [EmbedInput(text=t) for t in body.texts]

    async def _multimodal_item(self, body: EmbeddingsRequest) -> EmbedInput:
        """vLLM's ``messages`` form: one embedding for the conversation's media and text."""
        wire = ChatCompletionRequest(model=body.model, messages=body.messages or [])
        request = await self.converter.to_request(wire, uuid.uuid4().hex)
        parts = [p for m in request.messages for p in m.content]
        images = [p.image for p in parts if isinstance(p, ImagePart)]
        videos = [p.frames for p in parts if isinstance(p, VideoPart)]
        if len(images) + len(videos) > 1:
            raise InvalidRequest(
                "an embedding input holds at most one image or video", param="messages"
            )
        text = " ".join(p.text for p in parts if isinstance(p, TextPart)).strip() or None
        return EmbedInput(
            text=text, image=images[0] if images else None, frames=videos[0] if videos else None
        )
