"""Logprobs of sampled tokens: the log-softmax of the model's raw logits (vLLM's default
``raw_logprobs``), checked against full forwards of the real tiny checkpoint, on the batched
engine and on the one-at-a-time ``model.generate`` fallback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.engine.core.test_batching import make_backend, request
from tests.unit.engine.core.test_penalties import fallback  # noqa: F401  (fixture: the internvl generate path)

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.types import GenerateRequest

TOL = 1e-4  # float32: the paged forward and a full forward round differently


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


async def collect(backend: HFChatBackend, req: GenerateRequest) -> tuple[list[int], list[Any]]:
    """(token ids, their logprobs items) of one generation."""
    tokens: list[int] = []
    items: list[Any] = []
    async for chunk in backend.generate(await backend.prepare(req)):
        tokens += chunk.token_ids
        items += chunk.logprobs or []
    return tokens, items


def raw_logprobs(model: Any, inputs: dict[str, Any], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: log-softmax of the raw next-token logits before each token, from
    one full forward over prompt + tokens."""
    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    start = inputs["input_ids"].shape[1] - 1
    return logits[start : start + len(tokens)].log_softmax(dim=-1)


def check(
    backend: HFChatBackend, inputs: dict[str, Any], tokens: list[int], items: list[Any], top: int
) -> None:
    loaded = backend._require()
    expected = raw_logprobs(loaded.model, inputs, tokens)
    assert len(items) == len(tokens) > 0
    for step, (token, item) in enumerate(zip(tokens, items, strict=True)):
        assert item["logprob"] == pytest.approx(float(expected[step, token]), abs=TOL)
        text = loaded.processor.tokenizer.decode([token])
        assert item["token"] == text and item["bytes"] == list(text.encode())
        best_v, best_i = expected[step].topk(top)
        assert [e["logprob"] for e in item["top_logprobs"]] == pytest.approx(
            best_v.tolist(), abs=TOL
        )
        listed = [e["token"] for e in item["top_logprobs"]]
        assert listed == [loaded.processor.tokenizer.decode([i]) for i in best_i.tolist()]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
async def test_batched_logprobs_are_the_raw_log_softmax_of_the_sampled_tokens(
    backend: HFChatBackend, temperature: float
) -> None:
    req = request(
        "Describe a cat",
        max_tokens=12,
        temperature=temperature,
        seed=5,
        logprobs=True,
        top_logprobs=5,
    )
    tokens, items = await collect(backend, req)
    check(backend, (await backend.prepare(req)).inputs, tokens, items, 5)


async def test_logprobs_are_the_same_alone_and_in_a_busy_batch(backend: HFChatBackend) -> None:
    req = request("Describe a dog", max_tokens=10, logprobs=True, top_logprobs=2)
    alone = await collect(backend, req)
    others = [request(f"Other {i}", max_tokens=20) for i in range(4)]
    together = await asyncio.gather(collect(backend, req), *(collect(backend, r) for r in others))
    assert together[0][0] == alone[0]
    for a, b in zip(alone[1], together[0][1], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=TOL)
    assert all(not items for _, items in together[1:])  # not asked for: none computed


async def test_without_top_logprobs_each_item_lists_no_alternatives(
    backend: HFChatBackend,
) -> None:
    _, items = await collect(backend, request("Hi", max_tokens=4, logprobs=True))
    assert len(items) == 4 and all(item["top_logprobs"] == [] for item in items)


async def test_the_generate_fallback_reports_raw_logprobs_too(
    fallback: HFChatBackend,  # noqa: F811
) -> None:
    req = request(
        "Describe a cat", max_tokens=8, logprobs=True, top_logprobs=3, presence_penalty=1.0
    )
    tokens, items = await collect(fallback, req)
    check(fallback, (await fallback.prepare(req)).inputs, tokens, items, 3)
