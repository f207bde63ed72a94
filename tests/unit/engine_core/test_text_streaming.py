"""Incremental detokenisation and stop strings, on the tiny model's real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from vlmserve.engine.hf.detok import IncrementalDetokenizer
from vlmserve.engine.hf.stops import StopMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize(
    "text", ["héllo wörld", "中文 and 😀 emoji", "plain ascii, with 123 digits", "ü" * 7]
)
def test_pieces_concatenate_to_the_text_and_never_split_a_character(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_produce_no_text(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("ok", add_special_tokens=False)["input_ids"]
    assert "".join(detok.push(i) for i in [*ids, im_end]) + detok.flush() == "ok"


def test_invalid_bytes_are_emitted_eventually_not_held_forever(tokenizer) -> None:
    lone = tokenizer("中", add_special_tokens=False)["input_ids"][:1]  # first byte of 3
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(lone[0]) for _ in range(6))
    assert "\ufffd" in out  # a model emitting broken UTF-8 still makes progress


def test_stop_string_split_across_pieces_is_caught_and_dropped() -> None:
    matcher = StopMatcher(["STOP"])
    out, stopped = [], False
    for piece in ["hello S", "TO", "P and more"]:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "hello "


def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    emitted = "".join(matcher.feed(p)[0] for p in ["ST", "ay ", "here"]) + matcher.flush()
    assert emitted == "STay here"


def test_no_stops_passes_text_through_immediately() -> None:
    assert StopMatcher([]).feed("abc") == ("abc", False)
