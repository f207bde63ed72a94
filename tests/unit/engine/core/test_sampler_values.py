"""The batch sampler on hand-made logits: every value it can be given yields an id the model
can embed, and each step of the pipeline (penalty, EOS ban, temperature, top-k, top-p,
inverse CDF, seeds, grammar) does what transformers' processors do.

Rows are stand-ins with the fields of a ``Sequence`` the sampler reads; the logits are real
tensors and the grammar a real xgrammar matcher over the tiny checkpoint's tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from vlmserve.engine.core.sampler import Sampler, _inverse_cdf, _top_k_top_p
from vlmserve.engine.types import GREEDY_BELOW, MIN_PENALTY, MIN_TEMPERATURE, SamplingParams


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


def rows(*params: SamplingParams) -> list[Any]:
    return [Row(p) for p in params]


def seeded(seed: int, **kw: Any) -> Row:
    g = torch.Generator()
    g.manual_seed(seed)
    return Row(SamplingParams(**kw), generator=g)


def draws(sampler: Sampler, logits: torch.Tensor, batch: list[Any], n: int = 400) -> torch.Tensor:
    """[n, B] tokens: n independent draws for each row, made as one batch of n * B rows."""
    picked = sampler.sample(logits.repeat(n, 1), batch * n)
    return torch.tensor(picked).view(n, len(batch))


# --- degenerate values: always a token in the vocabulary --------------------------------------
@pytest.mark.parametrize("t", [0.0, 5e-324, 1e-300, 1e-45, 1e-30, 1e-6, math.nan])
def test_temperatures_below_1e_5_are_greedy(t: float) -> None:
    params = SamplingParams(temperature=t)
    assert params.greedy
    sampler = Sampler(6, set())
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.9, -1.0, 0.5]])
    assert set(draws(sampler, logits, rows(params), n=50)[:, 0].tolist()) == {2}


def test_temperatures_from_1e_5_sample_at_no_less_than_1e_2() -> None:
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert SamplingParams(temperature=GREEDY_BELOW).sampling_temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.5).sampling_temperature == 0.5
    sampler = Sampler(3, set())
    # At 1e-2 a gap of 0.01 is a factor e between the two top tokens: both are drawn.
    logits = torch.tensor([[0.0, 0.01, -5.0]])
    picked = draws(sampler, logits, rows(SamplingParams(temperature=1e-5)), n=300)
    share = (picked == 1).float().mean().item()
    assert abs(share - math.e / (1 + math.e)) < 0.1, share


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "bad",
    [
        [math.nan] * 5,
        [0.0, math.nan, 1.0, math.nan, 0.0],
        [0.0, math.inf, 1.0, math.inf, -math.inf],
        [-math.inf] * 5,
        [3.4e38, 3.4e38, -3.4e38, 0.0, 1.0],
    ],
    ids=["all-nan", "some-nan", "plus-inf", "all-masked", "huge"],
)
def test_nan_and_infinite_logits_still_give_a_token_in_the_vocabulary(
    bad: list[float], temperature: float
) -> None:
    sampler = Sampler(5, set())
    logits = torch.tensor([bad, [0.0, 0.0, 9.0, 0.0, 0.0]])
    params = SamplingParams(temperature=temperature)
    for _ in range(20):
        first, second = sampler.sample(logits.clone(), rows(params, params))
        assert 0 <= first < 5
        assert second == 2 or temperature > 0


def test_a_row_with_infinite_scores_takes_its_first_infinite_token() -> None:
    sampler = Sampler(5, set())
    logits = torch.tensor([[0.0, 1.0, math.inf, 2.0, math.inf], [0.0, 0.0, 0.0, 50.0, 0.0]])
    batch = rows(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0))
    assert {tuple(sampler.sample(logits.clone(), batch)) for _ in range(20)} == {(2, 3)}


def test_logit_columns_past_the_vocabulary_are_never_drawn() -> None:
    sampler = Sampler(4, set())
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 99.0, 99.0]])  # a padded lm_head: 6 > 4
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=2.0)):
        picked = draws(sampler, logits, rows(params), n=100)
        assert int(picked.max()) < 4


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-7, 1e300, math.inf, math.nan])
@pytest.mark.parametrize("temperature", [0.0, 1e-300, 2.0])
def test_extreme_repetition_penalties_keep_scores_finite(
    penalty: float, temperature: float
) -> None:
    sampler = Sampler(5, set())
    seen = torch.tensor([True, True, False, True, False])
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
    logits = torch.tensor([[1.0, -1.0, 0.5, 0.0, -2.0]])
    for _ in range(10):
        out = logits.clone()
        (token,) = sampler.sample(out, [Row(params, seen=seen)])
        assert 0 <= token < 5
        assert torch.isfinite(out).all(), out


def test_the_penalty_is_bounded_to_1e_6_and_nan_means_off() -> None:
    assert SamplingParams(repetition_penalty=1e-300).penalty == MIN_PENALTY
    assert SamplingParams(repetition_penalty=1e300).penalty == 1 / MIN_PENALTY
    assert SamplingParams(repetition_penalty=math.nan).penalty == 1.0
    assert SamplingParams(repetition_penalty=1.3).penalty == 1.3


# --- the repetition penalty, as transformers' RepetitionPenaltyLogitsProcessor ----------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    sampler = Sampler(6, set())
    seen = torch.tensor([True, True, True, False, False, True])
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0, -3.0, 0.5]] * 2)
    batch = [
        Row(SamplingParams(temperature=0, repetition_penalty=2.0), seen=seen),
        Row(SamplingParams(temperature=0)),  # no penalty: untouched
    ]
    sampler.sample(logits, batch)
    assert logits[0].tolist() == [1.0, -2.0, 0.0, 3.0, -3.0, 0.25]
    assert logits[1].tolist() == [2.0, -1.0, 0.0, 3.0, -3.0, 0.5]


def test_a_penalised_negative_logit_falls_below_an_unseen_one() -> None:
    sampler = Sampler(3, set())
    seen = torch.tensor([True, False, False])
    logits = torch.tensor([[-1.0, -1.5, -4.0]])  # penalty 2 takes token 0 to -2
    row = Row(SamplingParams(temperature=0, repetition_penalty=2.0), seen=seen)
    assert sampler.sample(logits, [row]) == [1]
    reward = Row(
        SamplingParams(temperature=0, repetition_penalty=0.5),
        seen=torch.tensor([False, True, False]),
    )
    assert sampler.sample(torch.tensor([[-1.0, -1.5, -4.0]]), [reward]) == [1]  # -0.75


# --- min_tokens -------------------------------------------------------------------------------
def test_eos_is_banned_until_min_tokens_unless_eos_is_ignored() -> None:
    sampler = Sampler(4, {2, 3})
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]] * 4)
    batch = [
        Row(SamplingParams(temperature=0, min_tokens=2), Run(1)),
        Row(SamplingParams(temperature=0, min_tokens=2), Run(2)),
        Row(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), Run(0)),
        Row(SamplingParams(temperature=0), Run(0)),
    ]
    assert sampler.sample(logits, batch) == [1, 2, 2, 2]


# --- top-k and top-p against transformers' warpers -----------------------------------------
def test_top_k_and_top_p_match_transformers_warpers_row_by_row() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    scores = torch.randn(6, 50) * 3
    top_k = [0, 1, 5, 50, 80, 3]
    top_p = [1.0, 1.0, 0.9, 0.3, 0.05, 0.6]
    got = _top_k_top_p(scores.clone(), top_k, top_p)
    for i in range(6):
        want = scores[i : i + 1].clone()
        if top_k[i] > 0:
            want = TopKLogitsWarper(top_k[i])(None, want)
        if top_p[i] < 1.0:
            want = TopPLogitsWarper(top_p[i])(None, want)
        assert torch.equal(got[i : i + 1].isinf(), want.isinf()), i
        assert torch.equal(got[i][~got[i].isinf()], want[0][~want[0].isinf()]), i


def test_top_k_keeps_exactly_k_tokens_per_row_and_0_or_minus_1_is_off() -> None:
    sampler = Sampler(8, set())
    logits = torch.arange(8.0).expand(4, 8) / 4  # token 7 most likely
    batch = rows(
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_k=0),
        SamplingParams(temperature=1.0, top_k=-1),
    )
    picked = draws(sampler, logits, batch)
    assert set(picked[:, 0].tolist()) == {7}
    assert set(picked[:, 1].tolist()) == {6, 7}
    assert len(set(picked[:, 2].tolist())) == 8
    assert len(set(picked[:, 3].tolist())) == 8


def test_top_k_over_the_vocabulary_keeps_everything() -> None:
    sampler = Sampler(4, set())
    logits = torch.zeros(1, 4)
    picked = draws(sampler, logits, rows(SamplingParams(temperature=1.0, top_k=1_000_000)))
    assert set(picked[:, 0].tolist()) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_top_token() -> None:
    sampler = Sampler(4, set())
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(4, 4)
    batch = rows(
        SamplingParams(temperature=1.0, top_p=0.65),  # 0.4 + 0.3 >= 0.65
        SamplingParams(temperature=1.0, top_p=5e-324),  # only the top token
        SamplingParams(temperature=1.0, top_p=1.0),
        SamplingParams(temperature=1.0, top_p=0.85),  # 0.1 goes (0.1 <= 1 - 0.85)
    )
    picked = draws(sampler, logits, batch, n=500)
    assert set(picked[:, 0].tolist()) == {2, 3}
    assert set(picked[:, 1].tolist()) == {3}
    assert set(picked[:, 2].tolist()) == {0, 1, 2, 3}
    assert set(picked[:, 3].tolist()) == {1, 2, 3}
    share = (picked[:, 0] == 3).float().mean().item()  # renormalised: 0.4 / 0.7
    assert abs(share - 4 / 7) < 0.08, share


def test_top_p_drops_a_token_whose_cumulative_share_equals_one_minus_p_exactly() -> None:
    sampler = Sampler(4, set())
    logits = torch.tensor([[-math.inf, -math.inf, 0.0, 0.0]])  # softmax exactly [0, 0, .5, .5]
    picked = draws(sampler, logits, rows(SamplingParams(temperature=1.0, top_p=0.5)), n=200)
    assert len(set(picked[:, 0].tolist())) == 1  # as transformers: cumulative <= 1 - p goes


# --- the inverse CDF -------------------------------------------------------------------------
def test_inverse_cdf_never_returns_a_zero_probability_token_on_an_exact_cdf_step() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([[0.0], [0.5], [0.9999], [1.0]])  # 0.5 * total lands on a step exactly
    picked, drawable = _inverse_cdf(probs, u)
    assert picked.tolist() == [1, 3, 3, 3]
    assert drawable.tolist() == [True] * 4


def test_inverse_cdf_draws_each_token_in_proportion_and_scales_by_the_total() -> None:
    probs = torch.tensor([[1.0, 2.0, 1.0]])  # unnormalised: total 4
    u = torch.linspace(0, 0.999, 1000)[:, None]
    picked, _ = _inverse_cdf(probs.expand(1000, 3), u)
    counts = torch.bincount(picked, minlength=3).tolist()
    assert [round(c / 1000, 2) for c in counts] == [0.25, 0.5, 0.25]


def test_inverse_cdf_flags_rows_with_nothing_to_draw() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.0], [math.nan, 0.5, 0.5], [0.2, 0.3, 0.5]])
    _, drawable = _inverse_cdf(probs, torch.full((3, 1), 0.5))
    assert drawable.tolist() == [False, False, True]


def test_sampled_tokens_follow_the_distribution_with_greedy_rows_mixed_in() -> None:
    sampler = Sampler(6, set())
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2, 0.0])
    logits = probs.log().expand(3, 6)
    batch = rows(
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
    )
    picked = draws(sampler, logits, batch, n=1500)
    assert set(picked[:, 1].tolist()) == {0}
    sampled = torch.cat([picked[:, 0], picked[:, 2]])
    share = torch.bincount(sampled, minlength=6).float() / len(sampled)
    assert torch.allclose(share, probs, atol=0.04), share.tolist()


def test_temperature_flattens_and_sharpens_the_distribution() -> None:
    sampler = Sampler(2, set())
    logits = torch.tensor([[0.0, 1.0]])
    for t in (0.5, 2.0):
        picked = draws(sampler, logits, rows(SamplingParams(temperature=t)), n=1500)
        want = 1 / (1 + math.exp(-1 / t))
        assert abs((picked == 1).float().mean().item() - want) < 0.05, t


# --- seeds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 77, -(2**63), 2**63 - 1])
def test_a_seeded_row_draws_the_same_tokens_whatever_its_companions(seed: int) -> None:
    sampler = Sampler(50, set())
    logits = torch.zeros(3, 50)

    def tokens(batch: list[Any], row: int) -> list[int]:
        return [sampler.sample(logits.clone(), batch)[row] for _ in range(30)]

    alone = tokens([seeded(seed, temperature=1.0)], 0)
    crowd = [
        Row(SamplingParams(temperature=1.0)),
        seeded(seed, temperature=1.0),
        seeded(seed + 1 if seed < 2**63 - 1 else 0, temperature=1.0),
    ]
    assert tokens(crowd, 1) == alone
    assert len(set(alone)) > 5  # really sampled


# --- grammar ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_grammar(tiny_dir: Path) -> Any:
    from vlmserve.engine.hf.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    compiler = GrammarCompiler(tokenizer, vocab_size=1038)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    return compiler.compile({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_rows_only_take_allowed_tokens_and_other_rows_are_untouched(
    digits_grammar: Any, temperature: float
) -> None:
    sampler = Sampler(1038, set())
    torch.manual_seed(1)
    logits = torch.randn(2, 1038)
    free = logits[1].clone()
    row = Row(SamplingParams(temperature=temperature), matcher=digits_grammar.matcher())
    out = logits.clone()
    token = sampler.sample(out, [row, Row(SamplingParams(temperature=0))])[0]
    assert row.matcher.accept(token) is None  # raises when the grammar refuses it
    assert torch.equal(out[1], free)
    assert int(out[0].isinf().sum()) > 1000  # nearly everything masked for the first token
