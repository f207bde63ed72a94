"""OpenAI's ``logit_bias`` on the real tiny checkpoint: +100 forces its token and -100 bans
it, on the batched engine (rows with and without a bias sharing steps) and on the
one-at-a-time ``model.generate`` fallback; a token id outside the vocabulary is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.unit.engine.core.test_batching import Outcome, make_backend, request, run

from vlmserve.engine.core.sampler import Sampler
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import SamplingParams
from vlmserve.errors import InvalidRequest

STEPS = 8
FORCED = 100  # an ordinary byte-level token the tiny model does not pick on its own


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


@pytest.fixture(scope="module")
def fallback(tiny_dir: Path) -> Iterator[HFChatBackend]:
    """The tiny model on the ``model.generate`` path: its engine closed after loading."""
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    b = HFChatBackend("tiny", options, max_model_len=4096)
    b.load()
    if b.engine is not None:
        b.engine.close()
        b.engine = None
    yield b
    b.close()


def biased(bias: dict[int, float], text: str = "Hello") -> object:
    return request(text, max_tokens=STEPS, logit_bias=bias)


async def test_plus_100_forces_and_minus_100_bans_in_a_batch_with_unbiased_rows(
    backend: HFChatBackend,
) -> None:
    plain = (await run(backend, request("Hello", max_tokens=STEPS))).tokens
    other = (await run(backend, request("Describe", max_tokens=STEPS))).tokens
    assert FORCED not in plain
    banned = {t: -100.0 for t in plain}
    rows_seen: list[int] = []
    engine = backend.engine
    assert engine is not None

    def watch(_: Outcome) -> None:
        rows_seen.append(engine.gauges.running)

    forced, avoided, again, again_other = await asyncio.gather(
        run(backend, biased({FORCED: 100.0}), watch),
        run(backend, biased(banned), watch),
        run(backend, request("Hello", max_tokens=STEPS), watch),
        run(backend, request("Describe", max_tokens=STEPS), watch),
    )
    assert max(rows_seen) >= 3  # the rows decoded together
    assert forced.tokens == [FORCED] * STEPS
    assert len(avoided.tokens) == STEPS and not set(avoided.tokens) & set(plain)
    assert again.tokens == plain and again_other.tokens == other  # unbiased rows unchanged


async def test_the_generate_fallback_forces_and_bans_the_same_way(
    fallback: HFChatBackend,
) -> None:
    plain = (await run(fallback, request("Hello", max_tokens=STEPS))).tokens
    assert (await run(fallback, biased({FORCED: 100.0}))).tokens == [FORCED] * STEPS
    avoided = (await run(fallback, biased({t: -100.0 for t in plain}))).tokens
    assert len(avoided) == STEPS and not set(avoided) & set(plain)
    assert (await run(fallback, request("Hello", max_tokens=STEPS))).tokens == plain


@pytest.mark.parametrize("token", [10**6, 2**40])
async def test_a_token_id_outside_the_vocabulary_is_a_400_naming_logit_bias(
    backend: HFChatBackend, token: int
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await backend.prepare(biased({token: 5.0}))
    assert caught.value.param == "logit_bias"
    assert str(token) in str(caught.value)


def test_the_sampler_adds_each_rows_bias_in_one_batch() -> None:
    class Row:  # the fields of a Sequence the sampler reads
        def __init__(self, bias: dict[int, float] | None) -> None:
            self.sampling = SamplingParams(temperature=0)
            self.run = type("Run", (), {"completion": 0})()
            self.matcher = self.seen = self.generator = self.step_logprobs = None
            self.bias = None
            if bias:
                self.bias = (torch.tensor(list(bias)), torch.tensor(list(bias.values())))

    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    rows = [Row({0: -0.2}), Row(None), Row({2: 1.5, 0: -100.0})]
    assert Sampler(3, set()).sample(logits, rows) == [1, 0, 2]
