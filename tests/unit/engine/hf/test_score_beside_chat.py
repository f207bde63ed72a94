"""A model served with the ``chat`` and ``rerank`` roles together: one copy of the weights,
scores on the chat engine between its steps, and one vision cache for both, so an image a
chat request encoded is not encoded again by a rerank request, and the other way round."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from vlmserve.engine.configs import ChatEngineConfig, RerankConfig
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.hf.score.backend import HFRerankBackend
from vlmserve.engine.types import (
    ChatMessage,
    EmbedInput,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    ScorePair,
    Serves,
    TextPart,
)
from vlmserve.testing.families.rerankers import build_qwen3_vl_reranker
from vlmserve.testing.media import gradient_image

TOL = 1e-4


def _options(path: Path) -> LoadOptions:
    return LoadOptions(source=str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return build_qwen3_vl_reranker()


@pytest.fixture(scope="module")
def chat(checkpoint: Path) -> Iterator[HFChatBackend]:
    backend = HFChatBackend(
        "tiny-chat-rerank",
        _options(checkpoint),
        ChatEngineConfig.defaults(vision_cache_bytes=2**26),
        scores=RerankConfig.defaults(),
    )
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def alone(checkpoint: Path) -> Iterator[HFRerankBackend]:
    backend = HFRerankBackend("tiny-rerank", _options(checkpoint), config=RerankConfig.defaults())
    backend.load()
    yield backend
    backend.close()


class TowerCalls:
    """Counts forward calls of the model's own vision tower (a forward hook)."""

    def __init__(self, backend: HFChatBackend):
        self.count = 0
        visual = backend._require().model.model.visual
        self._hook = visual.register_forward_hook(self._seen)

    def _seen(self, *_: object) -> None:
        self.count += 1

    def remove(self) -> None:
        self._hook.remove()


async def _chat_about(backend: HFChatBackend, image: Image.Image) -> None:
    content = [ImagePart(image=image), TextPart(text="what is this?")]
    request = GenerateRequest(
        request_id="chat-1",
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(max_tokens=2, temperature=0.0),
    )
    prepared = await backend.prepare(request)
    async for _ in backend.generate(prepared):
        pass


def _pairs(image: Image.Image) -> list[ScorePair]:
    query = EmbedInput("a picture of a gradient")
    return [ScorePair(query, EmbedInput(image=image)), ScorePair(query, EmbedInput("the sun"))]


def test_a_chat_model_with_the_rerank_role_also_serves_rerank(chat: HFChatBackend) -> None:
    assert chat.serves is Serves.CHAT and chat.also_serves == frozenset({Serves.RERANK})
    assert chat.scorer is not None and chat.scorer.packed
    assert chat.scorer.vision_cache is chat.engine.vision_cache  # type: ignore[union-attr]


async def test_an_image_chat_encoded_is_not_encoded_again_to_score_it(
    chat: HFChatBackend, alone: HFRerankBackend
) -> None:
    image = gradient_image(64, 48)
    calls = TowerCalls(chat)
    try:
        await _chat_about(chat, image)
        assert calls.count == 1
        scored = await chat.score(_pairs(image))
        assert calls.count == 1  # the chat's encoding, found in the shared cache
    finally:
        calls.remove()
    expected = alone.score_sync(_pairs(image)).scores
    assert scored.scores == pytest.approx(expected, abs=TOL)


async def test_an_image_scored_first_is_not_encoded_again_for_chat(chat: HFChatBackend) -> None:
    image = gradient_image(56, 72, seed=3)
    calls = TowerCalls(chat)
    try:
        await chat.score(_pairs(image))
        assert calls.count == 1
        await _chat_about(chat, image)
        assert calls.count == 1
    finally:
        calls.remove()
