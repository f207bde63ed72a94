"""Reading a batch's input file: every malformed line named by its number, or the requests."""

from __future__ import annotations

import json

from vlmserve.api.serving.batches_lines import parse_lines

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **extra: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m"}, **extra})  # fmt: skip


def test_good_lines_are_read_with_their_numbers_and_blank_lines_are_skipped() -> None:
    lines, errors = parse_lines(f"{line('a')}\n\n{line('b')}\n", CHAT)
    assert errors == []
    found = [(x.line, x.custom_id, x.body) for x in lines]
    assert found == [(1, "a", {"model": "m"}), (3, "b", {"model": "m"})]


def test_each_kind_of_malformed_line_is_named_with_its_line_number() -> None:
    text = "\n".join([
        line("a"), "{not json", "[1, 2]", json.dumps({"url": CHAT}), line("a"),
        line("c", url="/v1/embeddings"), line("d", method="GET"), '{"custom_id": "e", "x": NaN}',
    ])  # fmt: skip
    _, errors = parse_lines(text, CHAT)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "invalid_request"), (4, "missing_custom_id"),
        (5, "duplicate_custom_id"), (6, "mismatched_url"), (7, "invalid_method"),
        (8, "invalid_json_line"),
    ]  # fmt: skip
    assert errors[3]["message"] == "line 5: custom_id 'a' is used twice"


def test_an_empty_file_is_an_error() -> None:
    assert [e["code"] for e in parse_lines("\n \n", CHAT)[1]] == ["empty_file"]
