"""Reading a batch's input file: every malformed line named by its number, or the requests,
each read again from its offset."""

from __future__ import annotations

import json
from pathlib import Path

from vlmserve.api.endpoints.batches.input import read_request, scan_input

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **extra: object) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m"}, **extra}
    )


def scan(tmp_path: Path, data: str | bytes) -> tuple[list, list]:
    path = tmp_path / "in.jsonl"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    lines, errors = scan_input(path, CHAT)
    return [read_request(path, x) for x in lines], errors


def test_good_lines_are_read_with_their_numbers_and_blank_lines_are_skipped(
    tmp_path: Path,
) -> None:
    lines, errors = scan(tmp_path, f"{line('a')}\n\n{line('b')}\n")
    assert errors == []
    found = [(x.line, x.custom_id, x.body) for x in lines]
    assert found == [(1, "a", {"model": "m"}), (3, "b", {"model": "m"})]


def test_each_kind_of_malformed_line_is_named_with_its_line_number(tmp_path: Path) -> None:
    text = "\n".join(
        [
            line("a"),
            "{not json",
            "[1, 2]",
            json.dumps({"url": CHAT}),
            line("a"),
            line("c", url="/v1/embeddings"),
            line("d", method="GET"),
            '{"custom_id": "e", "x": NaN}',
        ]
    )
    _, errors = scan(tmp_path, text)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"),
        (3, "invalid_request"),
        (4, "missing_custom_id"),
        (5, "duplicate_custom_id"),
        (6, "mismatched_url"),
        (7, "invalid_method"),
        (8, "invalid_json_line"),
    ]
    assert errors[3]["message"] == "line 5: custom_id 'a' is used twice"


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    assert [e["code"] for e in scan(tmp_path, "\n \n")[1]] == ["empty_file"]


def test_lines_end_at_newline_only_so_raw_separators_inside_strings_are_kept(
    tmp_path: Path,
) -> None:
    odd = "a\u2028b\u0085c\u2029d\x0ce\x1cf"
    first = json.dumps({"custom_id": "x", "url": CHAT, "body": {"t": odd}}, ensure_ascii=False)
    text = "\ufeff" + first + "\r\n" + line("y") + "\r\n"
    lines, errors = scan(tmp_path, text)
    assert errors == []
    assert [(x.line, x.custom_id) for x in lines] == [(1, "x"), (2, "y")]
    assert lines[0].body == {"t": odd}


def test_a_line_nested_too_deeply_is_an_invalid_json_line_with_its_number(
    tmp_path: Path,
) -> None:
    deep = '{"custom_id": "d", "url": "' + CHAT + '", "body": ' + "[" * 5000 + "]" * 5000 + "}"
    _, errors = scan(tmp_path, f"{line('a')}\n{deep}\n")
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line")]
    assert "nested too deeply" in errors[0]["message"]
    assert "Recursion" not in errors[0]["message"]
