"""The guards' token rules (``engine/guards.py``): vLLM's repetition check on the cases its
own tests pin, and the thinking budget's count-then-force state machine."""

from __future__ import annotations

import pytest

from vlmserve.engine.guards import ThinkingBudget, looping, repeats
from vlmserve.engine.types import RepetitionDetection, SamplingParams


@pytest.mark.parametrize(
    ("tokens", "params", "expected"),
    [
        ([1, 2, 3] * 3, (3, 2, 3), True),
        ([1, 2, 3] * 2, (3, 2, 3), False),  # two copies, three asked for
        ([1, 2] * 4, (5, 2, 4), True),
        (list(range(1, 10)), (5, 2, 2), False),
        ([1, 2, 3, 1, 2, 3, 1, 2, 4], (3, 2, 3), False),  # the last copy differs
        ([], (3, 2, 2), False),
        ([1, 2, 3, 4, 5, 6, 5, 6, 5, 6], (3, 2, 3), True),  # only the tail counts
        ([1, 2, 3, 4, 5, 6, 7, 8] * 5, (10, 2, 3), True),
        ([10, 20] * 3, (5, 3, 3), False),  # a 2-token loop under min_pattern_size 3
        ([7] * 5, (4, 0, 5), True),  # min_pattern_size 0 counts as 1
        ([7] * 5, (0, 0, 5), False),  # max_pattern_size 0: off
    ],
)
def test_repeats_matches_vllms_check(
    tokens: list[int], params: tuple[int, int, int], expected: bool
) -> None:
    assert repeats(tokens, RepetitionDetection(*params)) is expected


def test_looping_waits_for_min_tokens_and_sees_a_resumed_prefix() -> None:
    detect = RepetitionDetection(4, 1, 3)
    sampling = SamplingParams(repetition_detection=detect, min_tokens=10)
    assert not looping(sampling, [1, 2] * 3)  # 6 tokens < min_tokens
    assert looping(sampling, [1, 2] * 5)
    resumed = SamplingParams(repetition_detection=detect)
    assert looping(resumed, [2, 1, 2], prefix=[5, 1, 2, 1])  # the loop began before resume
    assert not looping(SamplingParams(), [1] * 50)  # no detector


def test_a_budget_counts_reasoning_tokens_then_forces_the_end_tag() -> None:
    state = ThinkingBudget(3, end=[90, 91], thinking=True)
    for token in [5, 6]:
        assert state.forced() is None
        state.observe(token)
    state.observe(7)
    assert state.forced() == 90
    state.observe(90)
    assert state.forced() == 91
    state.observe(91)
    assert state.forced() is None and not state.thinking  # the answer is free


def test_a_model_that_ends_its_reasoning_in_time_is_never_forced() -> None:
    state = ThinkingBudget(5, end=[90], thinking=True)
    for token in [5, 90, 6, 7, 8, 9, 10]:
        state.observe(token)
        assert state.forced() is None


def test_a_budget_starts_counting_at_a_start_tag_the_model_writes() -> None:
    state = ThinkingBudget(1, end=[90], start=[80, 81])
    for token in [3, 4, 80]:
        state.observe(token)
        assert state.forced() is None
    state.observe(81)  # <think> complete: reasoning from here on
    assert state.forced() is None
    state.observe(5)
    assert state.forced() == 90


def test_a_budget_of_zero_forces_at_once() -> None:
    assert ThinkingBudget(0, end=[90], thinking=True).forced() == 90
