"""OpenAI's presence/frequency penalties: the sampler's formula on hand-made logits, and the
whole engine (batched, and the one-at-a-time ``model.generate`` fallback) against a plain
reference loop over the real tiny checkpoint's logits with the formula applied.

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

``count`` counts the tokens generated so far (the prompt's do not count).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.engine.core.test_batching import make_backend, request, run

from vlmserve.engine.core.sampler import Sampler
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import GenerateRequest, SamplingParams


@dataclass
class Run:
    completion: int = 0


@dataclass
class Row:  # the fields of a Sequence the sampler reads
    sampling: SamplingParams
    run: Run = field(default_factory=Run)
    matcher: Any = None
    seen: torch.Tensor | None = None
    generator: torch.Generator | None = None
    counts: torch.Tensor | None = None
    step_logprobs: Any = None


def openai_penalised(
    logits: torch.Tensor, generated: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """The formula as OpenAI documents it, written out token by token."""
    out = logits.clone()
    for j in set(generated):
        out[j] -= frequency * generated.count(j) + presence
    return out


def test_the_sampler_subtracts_frequency_times_count_plus_presence_once() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, 0.0]])
    generated = [0, 0, 0, 2, 4]
    counts = torch.bincount(torch.tensor(generated), minlength=6).float()
    params = SamplingParams(
        temperature=0, presence_penalty=0.7, frequency_penalty=0.4, logprobs=True, top_logprobs=6
    )
    row = Row(params, counts=counts)
    picked = Sampler(6, set(), logprobs_mode="processed").sample(logits.clone(), [row])
    expected = openai_penalised(logits[0], generated, 0.7, 0.4)
    assert picked == [int(expected.argmax())] == [1]  # token 0 lost its lead: 2 - 1.2 - 0.7
    scores = dict(row.step_logprobs[1])
    assert torch.allclose(
        torch.tensor([scores[j] for j in range(6)]), expected.log_softmax(0), atol=1e-6
    )


def test_negative_penalties_favour_repeated_tokens() -> None:
    logits = torch.tensor([[1.0, 1.2, 0.0]])
    row = Row(
        SamplingParams(temperature=0, presence_penalty=-0.5), counts=torch.tensor([1.0, 0.0, 0.0])
    )
    assert Sampler(3, set()).sample(logits, [row]) == [0]


def test_rows_without_penalties_are_untouched_in_a_mixed_batch() -> None:
    logits = torch.tensor([[1.0, 0.9], [1.0, 0.9]])
    rows = [
        Row(SamplingParams(temperature=0, frequency_penalty=2.0), counts=torch.tensor([1.0, 0.0])),
        Row(SamplingParams(temperature=0)),
    ]
    assert Sampler(2, set()).sample(logits, rows) == [1, 0]


def reference_greedy(
    model: Any, inputs: dict[str, Any], steps: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding by full forwards of the HF model, the OpenAI formula on its logits."""
    ids = inputs["input_ids"]
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
            token = int(openai_penalised(logits.float(), generated, presence, frequency).argmax())
            generated.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return generated


STEPS = 32  # the tiny model repeats itself within 32 greedy tokens of "Hello"


def penalised(text: str, **kw: Any) -> GenerateRequest:
    return request(
        text,
        max_tokens=STEPS,
        presence_penalty=kw.get("presence", 0.0),
        frequency_penalty=kw.get("frequency", 0.0),
    )


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


@pytest.mark.parametrize(
    ("presence", "frequency"), [(2.0, 0.0), (0.0, 2.0), (1.0, 1.5), (-2.0, 0.0)]
)
async def test_batched_penalties_follow_the_formula_on_the_models_logits(
    backend: HFChatBackend, presence: float, frequency: float
) -> None:
    req = penalised("Hello", presence=presence, frequency=frequency)
    ours = await run(backend, req)
    prepared = await backend.prepare(req)
    model = backend._require().model
    plain = reference_greedy(model, prepared.inputs, STEPS, 0.0, 0.0)
    assert ours.tokens == reference_greedy(model, prepared.inputs, STEPS, presence, frequency)
    assert ours.tokens != plain  # the penalties changed the answer (else this proves nothing)


@pytest.fixture(scope="module")
def fallback(tiny_dir: Path) -> Iterator[HFChatBackend]:
    """The tiny model on the ``model.generate`` path (what an architecture without a batched
    runner gets): its engine is closed and dropped after loading, so requests run alone."""
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    b = HFChatBackend("tiny", options, max_model_len=4096)
    b.load()
    if b.engine is not None:
        b.engine.close()
        b.engine = None
    yield b
    b.close()


async def test_the_generate_fallback_applies_the_same_formula(fallback: HFChatBackend) -> None:
    req = penalised("Hello", presence=1.0, frequency=1.5)
    ours = await run(fallback, req)
    prepared = await fallback.prepare(req)
    model = fallback._require().model
    assert ours.tokens == reference_greedy(model, prepared.inputs, STEPS, 1.0, 1.5)
    assert ours.tokens != reference_greedy(model, prepared.inputs, STEPS, 0.0, 0.0)
