"""Incremental detokenisation and stop strings, on the tiny model's real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.push(i) for i in ids] + [detok.flush()]


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_character_completed_after_four_held_tokens_is_not_replaced(tokenizer) -> None:
    """Each token is bytes 96 E7 95: a lone continuation byte, then two thirds of '畖'."""
    token = tokenizer.convert_tokens_to_ids(_byte_level("\x96\xe7\x95"))
    ids = [token] * 6
    assert _decode(tokenizer, ids) == "\ufffd" + "畖" * 5 + "\ufffd"
    assert "".join(_stream(tokenizer, ids)) == _decode(tokenizer, ids)


def test_a_long_run_of_unsettled_tails_streams_the_same_text(tokenizer) -> None:
    """Every prefix ends mid-character, so the window grows and is cut back while holding."""
    token = tokenizer.convert_tokens_to_ids(_byte_level("\x96\xe7\x95"))
    ids = [token] * 300
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == _decode(tokenizer, ids)
    assert sum(bool(p) for p in pieces) >= 290  # text flows; it is not all held to the end


@pytest.fixture(scope="module")
def partial_tokens(tokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 alone: pieces of multi-byte characters."""
    to_byte = {c: b for b, c in _byte_table().items()}
    out = []
    for piece, token_id in tokenizer.get_vocab().items():
        if all(c in to_byte for c in piece):
            try:
                bytes(to_byte[c] for c in piece).decode()
            except UnicodeDecodeError:
                out.append(token_id)
    return sorted(out)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_stream_concatenates_to_decode_of_all_ids(
    tokenizer, partial_tokens: list[int], data: st.DataObject
) -> None:
    """Random ids, most of them byte-level pieces of multi-byte characters, some special."""
    any_id = st.integers(min_value=0, max_value=len(tokenizer) - 1)
    token = st.one_of(st.sampled_from(partial_tokens), any_id)
    ids = data.draw(st.lists(token, min_size=1, max_size=160))
    assert "".join(_stream(tokenizer, ids)) == _decode(tokenizer, ids)


def _byte_table() -> dict[int, str]:
    """GPT-2's byte-level table: each byte's printable stand-in in BPE token strings."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(raw: str) -> str:
    """The byte-level BPE spelling of ``raw``'s code points taken as bytes."""
    table = _byte_table()
    return "".join(table[ord(c)] for c in raw)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Llama's decoder chain): characters outside the tiny vocab
    become ``<0xNN>`` byte tokens, which the decoder reads as one run."""
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab"]:
        vocab[piece] = len(vocab)
    bpe = BPE(vocab, [("▁", "a"), ("▁", "b"), ("a", "b")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet="ab 中é😀", max_size=60))
def test_a_byte_fallback_tokenizers_stream_equals_its_text(
    byte_fallback_tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    ids = byte_fallback_tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(byte_fallback_tokenizer, ids)
    assert "".join(pieces) == _decode(byte_fallback_tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)
