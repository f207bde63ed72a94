"""``benchmarks/equivalence.py``'s verdicts: same tokens, near-ties apart, partial characters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from peers.equivalence import compare, read_answer  # noqa: E402


def response(tokens: list[tuple[str, list[int], float, float]], prompt: int = 10) -> dict[str, Any]:
    """(token, bytes, logprob, runner-up logprob) per step."""
    content = [
        {
            "token": t,
            "bytes": b,
            "logprob": lp,
            "top_logprobs": [{"token": t, "logprob": lp}, {"token": "x", "logprob": second}],
        }
        for t, b, lp, second in tokens
    ]
    text = "".join(t for t, *_ in tokens)
    return {
        "choices": [{"message": {"content": text}, "logprobs": {"content": content}}],
        "usage": {"prompt_tokens": prompt},
    }


def test_identical_answers_are_the_same_and_a_partial_character_matches() -> None:
    ours = read_answer(
        200, response([("a", [97], -1.0, -2.0), ("\ufffd", [239, 191, 189], -0.5, -3)])
    )
    peer = read_answer(200, response([("a", [97], -1.0 + 1e-6, -2.0), ("\ufffd", [], -0.5, -3)]))
    verdict = compare(ours, peer)
    assert verdict.same_tokens and verdict.same_prompt
    assert verdict.max_logprob_diff < 2e-6


def test_a_split_at_a_near_tie_is_reported_apart_from_a_real_difference() -> None:
    ours = read_answer(200, response([("a", [97], -1.0, -1.0005), ("b", [98], -1, -2)]))
    tie = read_answer(200, response([("a", [97], -1.0, -1.0005), ("c", [99], -1, -2)]))
    real = read_answer(200, response([("z", [122], -1.0, -3.0), ("b", [98], -1, -2)], prompt=11))
    assert compare(ours, tie).diverged_at == 1 and not compare(ours, tie).near_tie
    near = read_answer(200, response([("a", [97], -1.0, -2.0), ("b", [98], -1, -1.0004)]))
    other = read_answer(200, response([("a", [97], -1.0, -2.0), ("c", [99], -1, -1.0004)]))
    assert compare(near, other).near_tie
    verdict = compare(ours, real)
    assert not verdict.same_tokens and not verdict.same_prompt and verdict.diverged_at == 0


def test_an_error_answer_is_never_the_same() -> None:
    ok = read_answer(200, response([("a", [97], -1.0, -2.0)]))
    failed = read_answer(400, {"error": {"message": "no"}})
    assert not compare(ok, failed).same_tokens and "HTTP 400" in compare(ok, failed).notes[0]


def test_a_reasoning_parser_moving_text_out_of_content_leaves_the_tokens_to_decide() -> None:
    steps = [("<think>", [1], -1.0, -2.0), ("a", [97], -1.0, -2.0)]
    split = response(steps)
    split["choices"][0]["message"] = {"content": "a", "reasoning": "..."}
    assert compare(read_answer(200, split), read_answer(200, response(steps))).same_tokens


def test_a_last_character_cut_by_max_tokens_is_the_same_written_either_way() -> None:
    steps = [("a", [97], -1.0, -2.0), ("\ufffd", [239, 191, 189], -1.0, -2.0)]
    kept = response(steps)
    dropped = response(steps)
    dropped["choices"][0]["message"]["content"] = "a"
    assert compare(read_answer(200, kept), read_answer(200, dropped)).same_tokens
