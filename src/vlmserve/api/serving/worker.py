"""Seed 000's task endpoints and ``/v1/embeddings``, on the models picked by role."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np

from vlmserve.api.protocol.chat import ChatCompletionRequest
from vlmserve.api.protocol.embeddings import EmbeddingsRequest
from vlmserve.api.protocol.worker import CaptionRequest, GenerateRequestIn
from vlmserve.api.serving.convert import Converter
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import HFEmbedBackend
from vlmserve.engine.hf.embed_inputs import EmbedInput
from vlmserve.engine.protocol import ChatBackend
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.engine.upstream import UpstreamBackend
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


def _sample(frames: list[str], limit: int) -> list[str]:
    """Uniformly pick at most ``limit`` frames before any is decoded."""
    if len(frames) <= limit:
        return frames
    return [frames[(2 * i + 1) * len(frames) // (2 * limit)] for i in range(limit)]


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


async def _forward(backend: UpstreamBackend, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A proxied model: the same endpoint on one of its replicas, under its upstream name."""
    return await backend.forward(path, {**body, "model": backend.config.model})


def token_texts(arrays: list[list[int]], tokenizer: Any) -> list[str]:
    """Token arrays are ids of the served model's own tokenizer (as vLLM reads them): checked
    against its vocabulary, then embedded as the text they decode to."""
    vocab = len(tokenizer)
    for i, ids in enumerate(arrays):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"input[{i}] holds token id {bad}, outside this model's vocabulary of {vocab}: "
                "token arrays must be ids of the served model's own tokenizer. Send the text "
                "instead (LangChain's OpenAIEmbeddings sends OpenAI-tokenizer ids unless you set "
                "check_embedding_ctx_length=False)",
                param="input",
                code="invalid_token_ids",
            )
    return [tokenizer.decode(ids) for ids in arrays]


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()


class WorkerService:
    def __init__(self, models: ModelManager, converter: Converter):
        self.models = models
        self.converter = converter

    @staticmethod
    def _nonempty(frames: list[str]) -> None:
        if not frames:
            raise InvalidRequest(
                "frames is empty; send at least one base64 JPEG frame", param="frames"
            )

    async def frames(self, frames: list[str]) -> list[Any]:
        self._nonempty(frames)
        picked = _sample(frames, self.converter.settings.max_video_frames)
        try:
            return list(await asyncio.gather(*(self.converter.image(f) for f in picked)))
        except VlmserveError as exc:
            exc.param = exc.param or "frames"
            raise

    async def encode_video(self, frames: list[str], model: str | None) -> list[float]:
        self._nonempty(frames)
        async with await self.models.acquire(model, EMBEDDING, HFEmbedBackend) as backend:
            if isinstance(backend, UpstreamBackend):
                return (await _forward(backend, "/encode-video", {"frames": frames}))["embedding"]
            decoded = await self.frames(frames)
            return (await backend.embed([EmbedInput(frames=decoded)]))[0].tolist()

    async def encode_text(self, text: str, model: str | None) -> list[float]:
        if not text.strip():
            raise InvalidRequest("text is empty", param="text")
        async with await self.models.acquire(model, EMBEDDING, HFEmbedBackend) as backend:
            if isinstance(backend, UpstreamBackend):
                return (await _forward(backend, "/encode-text", {"text": text}))["embedding"]
            return (await backend.embed([EmbedInput(text=text)]))[0].tolist()

    async def _run(self, backend: ChatBackend, request: GenerateRequest) -> str:
        prepared = await backend.prepare(request)
        return "".join([chunk.text async for chunk in backend.generate(prepared)])

    async def caption(self, body: CaptionRequest) -> str:
        self._nonempty(body.frames)
        async with await self.models.acquire(body.model, "caption", HFChatBackend) as backend:
            if isinstance(backend, UpstreamBackend):
                wire = body.model_dump(mode="json", exclude_unset=True)
                return (await _forward(backend, "/caption", wire))["caption"]
            frames = await self.frames(body.frames)
            sampling = SamplingParams(max_tokens=body.max_new_tokens, temperature=0.0)
            messages = caption_messages(frames, body.transcript)
            request = GenerateRequest(uuid.uuid4().hex, messages, sampling)
            return await self._run(backend, request)

    async def generate(self, body: GenerateRequestIn) -> str:
        async with await self.models.acquire(body.model, "chat", HFChatBackend) as backend:
            if isinstance(backend, UpstreamBackend):
                wire = body.model_dump(mode="json", exclude_unset=True)
                return (await _forward(backend, "/generate", wire))["text"]
            wire = ChatCompletionRequest(
                model=backend.model_id,
                messages=body.messages,
                max_tokens=body.max_new_tokens,
                temperature=body.temperature,
            )
            request = await self.converter.to_request(wire, uuid.uuid4().hex)
            return await self._run(backend, request)

    async def embeddings(self, body: EmbeddingsRequest) -> dict[str, Any]:
        handle = self.models.resolve(body.model) if body.model else None
        if handle is not None and isinstance(handle.backend, UpstreamBackend):
            return await self._proxied_embeddings(body)
        items = [EmbedInput(text=t) for t in body.texts]
        if body.messages is not None:
            items = [await self._multimodal_item(body)]
        async with await self.models.acquire(body.model, EMBEDDING, HFEmbedBackend) as backend:
            tokenizer = backend.processor.tokenizer
            if body.token_arrays is not None:
                items = [EmbedInput(text=t) for t in token_texts(body.token_arrays, tokenizer)]
            vectors = _truncate(await backend.embed(items), body.dimensions)
            tokens = sum(len(tokenizer(backend.render(item))["input_ids"]) for item in items)
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

    async def _proxied_embeddings(self, body: EmbeddingsRequest) -> dict[str, Any]:
        async with await self.models.acquire(body.model, EMBEDDING, HFEmbedBackend) as backend:
            wire = body.model_dump(mode="json", exclude_unset=True)
            answer = await _forward(backend, "/v1/embeddings", wire)
            return {**answer, "model": backend.model_id}

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
