"""Reasoning parsers: one-shot splits as vLLM's qwen3/deepseek_r1, and streams that agree."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.engine.parsers import REASONING_PARSERS, detect_reasoning_parser
from vlmserve.engine.parsers.reasoning import Phase, ReasoningParser, prompt_phase
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE
from vlmserve.testing.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
OPEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
PLAIN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def streamed(
    parser: ReasoningParser, deltas: list[str], prompt: str | None
) -> tuple[str, str, list[tuple[str, str]]]:
    stream = parser.stream(prompt=prompt)
    outs = [stream.feed(d) for d in deltas]
    outs.append(stream.finish())
    return "".join(r for r, _ in outs), "".join(c for _, c in outs), outs


def cuts(text: str, points: list[int]) -> list[str]:
    marks = sorted({p % (len(text) + 1) for p in points})
    bounds = [0, *marks, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(
    ("parser", "prompt", "text", "expected"),
    [
        # Thinking template: the prompt opened <think>, the output only closes it.
        (
            QWEN3,
            OPEN,
            "The quick brown</think> The answer is 42.",
            ("The quick brown", " The answer is 42."),
        ),
        # Older Qwen3: the model writes the whole block itself.
        (QWEN3, PLAIN, "<think>\nhmm\n</think>\n\nYes.", ("\nhmm\n", "\n\nYes.")),
        # A non-thinking output stays content.
        (QWEN3, PLAIN, "Just an answer.", (None, "Just an answer.")),
        # Cut off while thinking: all reasoning, as vLLM.
        (QWEN3, OPEN, "still thinking", ("still thinking", "")),
        # enable_thinking=false closed the block in the prompt: tags are plain text.
        (QWEN3, CLOSED, "a </think> b", (None, "a </think> b")),
        # The model re-opens the block the prompt opened: the tag is dropped.
        (QWEN3, OPEN, "<think>x</think>y", ("x", "y")),
        # R1 writes no <think>: the output starts inside reasoning.
        (R1, PLAIN, "reason</think>answer", ("reason", "answer")),
        (R1, None, "<think>reason</think>answer", ("reason", "answer")),
        (R1, None, "no end tag", ("no end tag", "")),
        (R1, CLOSED, "text", (None, "text")),
    ],
)
def test_split_matches_vllm_conventions(
    parser: ReasoningParser, prompt: str | None, text: str, expected: tuple[str | None, str]
) -> None:
    assert parser.split(text, prompt=prompt) == expected


def test_end_tag_split_over_deltas_is_held_back_until_decided() -> None:
    stream = QWEN3.stream(prompt=OPEN)
    assert stream.feed("The quick brown</th") == ("The quick brown", "")
    assert not stream.reasoning_ended
    assert stream.feed("ink> The") == ("", " The")
    assert stream.reasoning_ended
    assert stream.feed(" answer") == ("", " answer")
    assert stream.finish() == ("", "")


def test_a_false_tag_prefix_is_released_as_reasoning() -> None:
    stream = QWEN3.stream(prompt=OPEN)
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b") == ("</b", "")
    assert stream.feed("</thin") == ("", "")
    assert stream.finish() == ("</thin", "")


def test_start_tag_prefix_in_content_is_released_at_finish() -> None:
    stream = QWEN3.stream(prompt=PLAIN)
    assert stream.feed("x <thi") == ("", "x ")
    assert stream.finish() == ("", "<thi")


def test_prompt_phase_reads_the_last_tag() -> None:
    assert prompt_phase(None) is Phase.BEFORE
    assert prompt_phase(PLAIN) is Phase.BEFORE
    assert prompt_phase(OPEN) is Phase.REASONING
    assert prompt_phase(CLOSED) is Phase.AFTER
    assert prompt_phase("<think>a</think>b<think>\n") is Phase.REASONING
    # Tags inside a user message do not decide: the template's markers follow them.
    assert prompt_phase("<|im_start|>user\nwhat is <think>?<|im_end|>\n" + PLAIN) is Phase.BEFORE


TEXTS = [
    "The quick brown</think> The answer is 42.",
    "<think>\nhmm</think>\n\nYes.",
    "<think><think></think></think>",
    "pre <think>mid</think> post </think> <think>",
    "<</<th</think<think>>",
    "",
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.sampled_from(TEXTS),
        st.text(alphabet=st.sampled_from(list("<>/thinkab \n")), max_size=40),
    ),
    points=st.lists(st.integers(min_value=0, max_value=64), max_size=12),
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    prompt=st.sampled_from([None, OPEN, CLOSED, PLAIN]),
)
def test_every_split_into_deltas_streams_the_one_shot_result(
    text: str, points: list[int], name: str, prompt: str | None
) -> None:
    parser = REASONING_PARSERS[name]
    reasoning, content = parser.split(text, prompt=prompt)
    got_reasoning, got_content, _ = streamed(parser, cuts(text, points), prompt)
    assert (got_reasoning, got_content) == (reasoning or "", content)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("<>/thinkab")), max_size=30))
def test_the_stream_holds_back_less_than_a_tag(text: str) -> None:
    stream = QWEN3.stream(prompt=OPEN)
    stream.feed(text)
    held = stream.finish()  # exactly what feed did not release
    assert len(held[0]) + len(held[1]) <= len("</think>") - 1


def test_detects_the_thinking_template_and_not_the_plain_one() -> None:
    assert detect_reasoning_parser(THINKING_CHAT_TEMPLATE) == "qwen3"
    assert detect_reasoning_parser(QWEN2_VL_CHAT_TEMPLATE) is None
    assert detect_reasoning_parser(TOOLS_CHAT_TEMPLATE) is None  # think only in its history
    assert detect_reasoning_parser(None) is None


def test_detects_qwen3_hybrid_and_deepseek_templates() -> None:
    hybrid = (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
    )
    assert detect_reasoning_parser(hybrid) == "qwen3"
    # Only the history strips think blocks (Qwen3-VL-Instruct style): not a thinking template.
    history_only = (
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
        "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert detect_reasoning_parser(history_only) is None
    r1 = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    assert detect_reasoning_parser(r1) == "deepseek_r1"
