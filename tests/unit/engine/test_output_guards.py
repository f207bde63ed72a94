"""The output guards on real checkpoints, on the batched engine (rows with and without a
guard sharing steps) and on the one-at-a-time ``model.generate`` fallback:
``allowed_token_ids`` restricts greedy output, ``repetition_detection`` ends a looping
answer with finish reason ``repetition``, ``thinking_token_budget`` closes the reasoning
after N tokens and the model answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_batching import make_backend, request, run

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import FinishReason, GenerateRequest, RepetitionDetection
from vlmserve.errors import InvalidRequest
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, build_scripted

LOOP = " Total: 12.50 EUR"  # 14 distinct tokens, emitted over and over
REASONING = " Let me count the legs of each cat and then add them up carefully"
ANSWER = "\n\nTwelve legs."
DETECT = RepetitionDetection(max_pattern_size=20, min_pattern_size=2, min_count=3)


def fallback_backend(model_dir: Path) -> HFChatBackend:
    """A checkpoint on the ``model.generate`` path: its engine closed after loading."""
    options = LoadOptions(source=str(model_dir), device="cpu", dtype="float32")
    b = HFChatBackend("tiny", options, max_model_len=4096)
    b.load()
    if b.engine is not None:
        b.engine.close()
        b.engine = None
    return b


@pytest.fixture(scope="module", params=["batched", "fallback"])
def tiny(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8) if request.param == "batched" else None
    b = b or fallback_backend(tiny_dir)
    yield b
    b.close()


@pytest.fixture(scope="module", params=["batched", "fallback"])
def looping(request: pytest.FixtureRequest) -> Iterator[HFChatBackend]:
    model = build_scripted(LOOP, loop=True)
    b = make_backend(model, max_num_seqs=8) if request.param == "batched" else None
    b = b or fallback_backend(model)
    yield b
    b.close()


@pytest.fixture(scope="module", params=["batched", "fallback"])
def thinking(request: pytest.FixtureRequest) -> Iterator[HFChatBackend]:
    model = build_scripted(REASONING + "</think>" + ANSWER, template=THINKING_CHAT_TEMPLATE)
    b = make_backend(model, max_num_seqs=8) if request.param == "batched" else None
    b = b or fallback_backend(model)
    yield b
    b.close()


async def test_allowed_token_ids_restrict_greedy_output_alone_and_in_a_batch(
    tiny: HFChatBackend,
) -> None:
    plain = (await run(tiny, request("Hello", max_tokens=8))).tokens
    allowed = [100, 101, 102, plain[3]]  # the model's 4th choice, and three it never takes
    alone = (await run(tiny, request("Hello", max_tokens=8, allowed_token_ids=allowed))).tokens
    assert set(alone) <= set(allowed) and alone != plain
    together = await asyncio.gather(
        run(tiny, request("Hello", max_tokens=8, allowed_token_ids=allowed)),
        run(tiny, request("Hello", max_tokens=8)),
        run(tiny, request("Hello", max_tokens=8, allowed_token_ids=[plain[0]])),
    )
    assert together[0].tokens == alone  # the same with other rows in its steps
    assert together[1].tokens == plain  # rows without the guard are unchanged
    assert together[2].tokens == [plain[0]] * 8


async def test_allowed_token_ids_outside_the_vocabulary_are_a_400(tiny: HFChatBackend) -> None:
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary") as caught:
        await run(tiny, request("Hello", allowed_token_ids=[5, 10**6]))
    assert caught.value.param == "allowed_token_ids"


async def test_a_looping_answer_stops_at_the_repetition(looping: HFChatBackend) -> None:
    free = await run(looping, request("Read the receipt", max_tokens=60))
    assert free.text.startswith(LOOP * 4) and free.finish is FinishReason.LENGTH
    guarded, other = await asyncio.gather(
        run(looping, request("Read the receipt", max_tokens=60, repetition_detection=DETECT)),
        run(looping, request("Read the receipt", max_tokens=60)),
    )
    assert guarded.text == LOOP * 3  # 3 copies of the 14-token pattern: 42 tokens
    assert guarded.finish is FinishReason.REPETITION and guarded.completion_tokens == 42
    assert other.tokens == free.tokens  # the unguarded row beside it loops on


async def test_repetition_waits_for_min_tokens_and_yields_to_max_tokens(
    looping: HFChatBackend,
) -> None:
    late = await run(
        looping, request("Read", max_tokens=60, repetition_detection=DETECT, min_tokens=50)
    )
    assert late.finish is FinishReason.REPETITION and late.completion_tokens == 50
    capped = await run(looping, request("Read", max_tokens=42, repetition_detection=DETECT))
    assert capped.finish is FinishReason.LENGTH and capped.completion_tokens == 42


def ask(budget: int | None = None) -> GenerateRequest:
    """A question to the thinking model, answered until its EOS."""
    req = request("How many legs?", max_tokens=60, thinking_token_budget=budget)
    req.sampling.ignore_eos = False
    return req


async def test_a_thinking_budget_closes_the_reasoning_and_the_model_answers(
    thinking: HFChatBackend,
) -> None:
    free = await run(thinking, ask())
    assert (free.reasoning, free.text) == (REASONING, ANSWER)
    tokenizer = thinking._require().processor.tokenizer
    first8 = tokenizer.decode(tokenizer.encode(REASONING, add_special_tokens=False)[:8])
    budget, unlimited = await asyncio.gather(run(thinking, ask(8)), run(thinking, ask()))
    assert (budget.reasoning, budget.text) == (first8, ANSWER)
    assert budget.finish is FinishReason.STOP
    assert (unlimited.reasoning, unlimited.text) == (REASONING, ANSWER)
    zero = await run(thinking, ask(0))
    assert (zero.reasoning, zero.text) == ("", ANSWER)
